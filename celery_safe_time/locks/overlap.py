"""``@overlap_lock``: at most one run per key at a time, across every worker.

::

    @app.task(bind=True)
    @overlap_lock("inventory-sync:{account_id}", ttl=600, on_conflict="retry", retry_after=10)
    def sync_inventory(self, account_id): ...

While the body runs, ``self.request.safe_time_fence`` holds the lock's fencing number (it
grows with every new holder of the key) and ``self.request.safe_time_lock`` the held lock.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

from celery.exceptions import Ignore

from . import constants as C
from .config import get_config
from .exceptions import LockConflict, RedisUnavailable
from .guard import (
    Call,
    HeldLock,
    acquire,
    jittered,
    requeue,
    resolve_call,
    run_holding,
    send_conflict,
)
from .hard_limit import hard_deadline
from .keys import KeyBuilder, KeySpec
from .lockstore import Holder, get_lock_store

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class Policy:
    """Validated options shared by ``overlap_lock`` and ``idempotent``."""

    def __init__(
        self,
        *,
        ttl: float | None,
        on_conflict: str,
        retry_after: float,
        jitter: float | None,
        on_redis_error: str,
    ) -> None:
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        if on_conflict not in C.ON_CONFLICT_POLICIES:
            raise ValueError(f"on_conflict must be one of {sorted(C.ON_CONFLICT_POLICIES)}, got {on_conflict!r}")
        if on_redis_error not in C.ON_REDIS_ERROR_POLICIES:
            raise ValueError(
                f"on_redis_error must be one of {sorted(C.ON_REDIS_ERROR_POLICIES)}, got {on_redis_error!r}"
            )
        if not retry_after >= 0:
            raise ValueError(f"retry_after must not be negative, got {retry_after!r}")
        if jitter is not None and not jitter >= 0:
            raise ValueError(f"jitter must not be negative, got {jitter!r}")
        self.ttl = ttl
        self.on_conflict = on_conflict
        self.retry_after = float(retry_after)
        self.jitter = float(retry_after * C.DEFAULT_LOCK_RETRY_JITTER if jitter is None else jitter)
        self.on_redis_error = on_redis_error

    def lock_ttl(self, call: Call) -> float:
        return self.ttl if self.ttl is not None else get_config(call.app).lock_ttl

    def conflict(self, call: Call, key: str, holder: Holder | None) -> None:
        """Apply ``on_conflict``: returns for ``skip``, raises for ``raise`` and ``retry``."""
        who = holder.describe() if holder is not None else None
        send_conflict(call, key, who, self.on_conflict)
        if self.on_conflict == "skip":
            logger.info("skipping %s: overlap lock %r is held by %s", call.task_id, key, who)
            return
        exc = LockConflict(key, who)
        if self.on_conflict == "raise":
            raise exc
        countdown = jittered(self.retry_after, self.jitter)
        logger.info("overlap lock %r is held by %s; re-queueing %s in %.1fs", key, who, call.task_id, countdown)
        requeue(call, countdown, exc)

    def redis_down(self, call: Call, exc: RedisUnavailable) -> None:
        """Never run unguarded: re-queue (default) or raise."""
        if self.on_redis_error == "raise":
            raise exc
        countdown = jittered(self.retry_after, self.jitter)
        logger.warning("%s; re-queueing %s in %.1fs", exc, call.task_id, countdown)
        requeue(call, countdown, exc)

    @staticmethod
    def duplicate(call: Call, key: str, holder: Holder | None) -> NoReturn:
        """The very same delivery is running right now (a redelivered message): drop this copy."""
        who = holder.describe() if holder is not None else None
        logger.warning("dropping a second delivery of %s: it is running now and holds %r", call.task_id, key)
        send_conflict(call, key, who, "duplicate")
        raise Ignore()


class LockGuard:
    """The lock one decorated function takes around its body."""

    namespace = ""

    def __init__(self, builder: KeyBuilder, policy: Policy) -> None:
        self.builder = builder
        self.policy = policy

    def lock_key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, bound: bool) -> str:
        """The lock key (without prefix) of a call; ``args`` exclude the task instance."""
        return self.namespace + self.builder.render(args, kwargs, bound=bound)

    def __call__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = resolve_call(args, kwargs)
        key = self.lock_key_for(call.args, call.kwargs, bound=call.bound)
        taken = self.take(call, key)
        if taken is None:
            return None
        held, deadline = taken
        logger.debug("task %s holds overlap lock %r (fence %s)", held.task_id, key, held.fence)
        return run_holding(held, call, lambda: func(*args, **kwargs), deadline)

    def take(self, call: Call, key: str, marker: str | None = None) -> tuple[HeldLock, float | None] | None:
        """Acquire ``key`` for ``call``: the held lock and the hard deadline, or None when the body
        must not run (the policy has handled a conflict, a duplicate or Redis being down)."""
        ttl = self.policy.lock_ttl(call)
        owner = call.owner()
        deadline = hard_deadline(call, time.monotonic())
        try:
            store = get_lock_store(call.app)
            acquired, token = acquire(store, key, ttl, owner, deadline, marker=marker)
        except RedisUnavailable as exc:
            self.policy.redis_down(call, exc)
            return None
        if acquired.status == "done" and marker is not None:
            self.already_done(call, marker)
            return None
        if acquired.status == "duplicate":
            self.policy.duplicate(call, key, acquired.holder)
        if acquired.status != "acquired" or acquired.fence is None:
            self.policy.conflict(call, key, acquired.holder)
            return None
        return HeldLock(store, key, token, acquired.fence, ttl, owner.task_id), deadline

    def already_done(self, call: Call, marker: str) -> None:
        """The key's marker says it already ran (only guards that pass a marker get here)."""


def wrap(func: F, guard: LockGuard) -> F:
    """Wrap ``func`` so every call runs through ``guard``; keeps its name and signature."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return guard(func, args, kwargs)

    # Celery checks call arguments against the task's signature; keep the real one.
    wrapper.__signature__ = guard.builder.signature  # type: ignore[attr-defined]
    wrapper.__safe_time_guards__ = (*getattr(func, "__safe_time_guards__", ()), guard)  # type: ignore[attr-defined]
    return cast(F, wrapper)


def overlap_lock(
    key: KeySpec,
    *,
    ttl: float | None = None,
    on_conflict: str = "retry",
    retry_after: float = C.DEFAULT_LOCK_RETRY_AFTER,
    jitter: float | None = None,
    on_redis_error: str = "retry",
) -> Callable[[F], F]:
    """Hold a per-key Redis lock while the task body runs; place it below ``@app.task``.

    ``key``: a template over the task's parameters (``"sync:{account_id}"``) or a callable
    taking the task's arguments. ``ttl``: lock lease in seconds (default ``safe_time_lock_ttl``),
    renewed every ``ttl/3`` while the body runs. ``on_conflict``: ``"retry"`` re-queues the
    message after ``retry_after`` plus up to ``jitter`` seconds (default ``retry_after/2``),
    ``"skip"`` returns None without running, ``"raise"`` raises
    :class:`~celery_safe_time.exceptions.LockConflict`. ``on_redis_error``: ``"retry"`` or
    ``"raise"`` (:class:`~celery_safe_time.exceptions.RedisUnavailable`): the body never runs
    without the lock.
    """
    policy = Policy(
        ttl=ttl, on_conflict=on_conflict, retry_after=retry_after, jitter=jitter, on_redis_error=on_redis_error
    )

    def decorate(func: F) -> F:
        return wrap(func, LockGuard(KeyBuilder(func, key), policy))

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
