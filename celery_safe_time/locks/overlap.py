"""``@overlap_lock``: at most one run per key at a time, across every worker.

::

    @app.task(bind=True)
    @overlap_lock("inventory-sync:{account_id}", ttl=600, on_conflict="retry", retry_after=10)
    def sync_inventory(self, account_id): ...

While the body runs, ``self.request.safe_time_fence`` holds the lock's fencing number (it
grows with every new holder of the key) and ``self.request.safe_time_lock`` the held lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from .. import constants as C
from .keys import KeyBuilder, KeySpec
from .runtime import HeldLock, Policy, TaskLock, check_decorates_function, wrap

logger = logging.getLogger(__name__)

__all__ = ["current_fence", "current_lock", "overlap_lock"]

F = TypeVar("F", bound=Callable[..., Any])


def overlap_lock(
    key: KeySpec,
    *,
    ttl: float | None = None,
    on_conflict: C.OnConflict = "retry",
    retry_after: float = C.DEFAULT_LOCK_RETRY_AFTER,
    jitter: float | None = None,
    on_backend_error: C.OnBackendError = "retry",
) -> Callable[[F], F]:
    """Hold a per-key lock while the task body runs; place it below ``@app.task``.

    ``key``: a template over the task's parameters (``"sync:{account_id}"``) or a callable
    taking the task's arguments. ``ttl``: lock lease in seconds (default ``safe_time_lock_ttl``),
    renewed every ``ttl/3`` while the body runs. ``on_conflict``: ``"retry"`` re-queues the
    message after ``retry_after`` plus up to ``jitter`` seconds (default ``retry_after/2``),
    ``"skip"`` returns None without running, ``"raise"`` raises
    :class:`~celery_safe_time.exceptions.LockConflict`. ``on_backend_error``, when the lock backend
    (Redis, or PostgreSQL with ``safe_time_coordination_url``) cannot be reached: ``"retry"`` re-queues
    with back-off, ``"raise"`` raises :class:`~celery_safe_time.exceptions.CoordinationUnavailable`
    (:class:`~celery_safe_time.exceptions.RedisUnavailable` on Redis): the body never runs without the
    lock.
    """
    # ``@overlap_lock`` without arguments above ``@app.task`` passes the task as the key.
    check_decorates_function(key, "overlap_lock", '"my-key:{arg}"')
    policy = Policy(
        ttl=ttl, on_conflict=on_conflict, retry_after=retry_after, jitter=jitter, on_backend_error=on_backend_error
    )

    def decorate(func: F) -> F:
        check_decorates_function(func, "overlap_lock", repr(key) if isinstance(key, str) else "key")
        return wrap(func, TaskLock(KeyBuilder(func, key), policy))

    return decorate


def current_lock() -> HeldLock | None:
    """The lock held by the running task (innermost decorator), or None."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    held = getattr(request, C.REQUEST_LOCK_ATTR, None)
    return held if isinstance(held, HeldLock) else None


def current_fence() -> int | None:
    """The fencing number of the running task's lock, for guarding downstream writes."""
    held = current_lock()
    return held.fence if held is not None else None
