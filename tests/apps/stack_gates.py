"""The gates the stacked-gate tasks of ``locks_app`` are built from (``locks.stack.<outer>.<inner>``,
every ordered pair), importable without a worker's environment: the fault module generates its cases
from this dict too, so a gate joins both by joining it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_safe_time import concurrency_limit, idempotent, overlap_lock, rate_limit

Decorate = Callable[[Callable[..., Any]], Callable[..., Any]]

#: name -> (how many calls of one key may run at once under it, None: no bound; the decorator, given
#: the lock ttl and the retry pause)
STACK_GATES: dict[str, tuple[int | None, Callable[[float, float], Decorate]]] = {
    "overlap_lock": (1, lambda ttl, wait: overlap_lock("stack-ol:{key}", ttl=ttl, retry_after=wait)),
    "concurrency_limit": (2, lambda ttl, wait: concurrency_limit("stack-cl:{key}", limit=2, ttl=ttl, retry_after=wait)),
    "rate_limit": (None, lambda ttl, wait: rate_limit("stack-rl:{key}", "4/s")),
    "idempotent": (None, lambda ttl, wait: idempotent("stack-idem:{key}:{n}", ttl=ttl, retry_after=wait)),
}
