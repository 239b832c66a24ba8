"""Attempt tokens and re-queue timing, shared by the lock runtime and the stored-task delivery check.

Every task message published by a process that imported this package carries
``safe_time_attempt``, a fresh random token per publish. A broker redelivery of the same message
(after a worker died holding it unacked) keeps the token; ``retry()``, a lock re-queue or a sweep
republish is a new publish and gets a new one. So "the same token" means "the very same
message", which a task id cannot say: ids are reused by ``retry()`` and by callers on purpose.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Literal

from celery.signals import before_task_publish

from .. import constants as C
from .randomness import uuid4_hex


def jittered(retry_after: float, jitter: float, rand: Callable[[], float] = random.random) -> float:
    """``retry_after`` plus up to ``jitter`` seconds, so re-queued runs do not collide again."""
    return retry_after + jitter * rand()


def outage_backoff(base: float, outage_age: float, cap: float) -> float:
    """Seconds before the next attempt once a dependency has been unreachable for ``outage_age``
    seconds: ``base`` at first, then ``LOCK_REDIS_DOWN_BACKOFF_SHARE`` of the outage so far, at most
    ``cap`` (and never below ``base``)."""
    return max(base, min(cap, max(outage_age, 0.0) * C.LOCK_REDIS_DOWN_BACKOFF_SHARE))


#: Where a call that must wait goes: back to the broker with a countdown, or into the durable store.
WaitRoute = Literal["broker", "store"]


def wait_route(countdown: float, threshold: float) -> WaitRoute:
    """Where a re-queue of ``countdown`` seconds goes: the broker only at or below ``threshold``
    (``safe_time_delay_threshold``, below the visibility timeout and the consumer timeout), the
    store beyond it. A broker holds a countdown as an unacknowledged message: a longer one is handed
    out again (Redis, SQS) or closes the worker's channel (RabbitMQ), and its copy is a new call.
    The rule is ``SafeTask``'s for its own countdowns, so a wait routes the same for every task."""
    return "broker" if countdown <= threshold else "store"


def new_attempt() -> str:
    return uuid4_hex()


def message_header(request: Any, name: str) -> Any:
    """A message header of ``request``: in ``request.headers``, or set on the request itself (where
    Celery puts the custom headers of a protocol 2 message); None when absent."""
    headers = getattr(request, "headers", None)
    if headers and name in headers:
        return headers[name]
    # Not getattr(request, name, None): most headers are absent, and a missing attribute is an
    # AttributeError raised and caught, several per locked call.
    own = getattr(request, "__dict__", None)
    if own is not None:
        return own.get(name)
    return getattr(request, name, None)


def attempt_of(request: Any) -> str | None:
    """The attempt token of the message ``request`` came from, or None (published without this package)."""
    value = message_header(request, C.HEADER_ATTEMPT)
    return str(value) if value else None


def _stamp_attempt(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    # retry() and signature_from_request() copy the running request's headers: overwrite, never keep.
    if headers is not None:
        headers[C.HEADER_ATTEMPT] = new_attempt()


before_task_publish.connect(_stamp_attempt, weak=False, dispatch_uid="celery_safe_time.messages.requeue.stamp_attempt")
