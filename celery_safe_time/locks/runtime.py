"""What ``overlap_lock`` and ``idempotent`` share: finding the running task, the options
(:class:`Policy`), taking the lock (:class:`TaskLock`), holding it around the body (watchdog,
fencing number, ``LockLost``) and re-queueing on a conflict.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import redis
from celery import Celery, Task, current_app
from celery._state import get_current_task
from celery.exceptions import Ignore, Retry

from .. import constants as C
from .. import signals
from ..config import get_config, mask_url
from ..exceptions import LockConflict, LockLost, RedisUnavailable, SafeTimeError
from ..requeue import jittered
from .hard_limit import hard_deadline
from .keys import KeyBuilder
from .store import Acquired, Holder, LockStore, Owner, get_lock_store
from .watchdog import Interrupter, Watchdog, renewal_ttl

logger = logging.getLogger(__name__)

R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_HOST = socket.gethostname()


@dataclasses.dataclass
class Call:
    """One call of a decorated task function."""

    task: Task | None
    bound: bool
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    app: Celery

    @property
    def request(self) -> Any:
        return self.task.request if self.task is not None else None

    @property
    def task_id(self) -> str | None:
        request = self.request
        return getattr(request, "id", None) if request is not None else None

    @property
    def in_worker(self) -> bool:
        """True when the call came from a message (so it can be re-queued)."""
        request = self.request
        return bool(
            request is not None
            and request.id
            and not getattr(request, "called_directly", True)
            and not getattr(request, "is_eager", False)
        )

    def owner(self) -> Owner:
        request = self.request
        task_id = self.task_id or f"direct-{uuid.uuid4().hex}"
        retries = getattr(request, "retries", 0) or 0
        requeues = _requeues(request)
        return Owner(task_id=task_id, identity=f"{task_id}:{retries}:{requeues}", host=_HOST, pid=os.getpid())

    def render(self, builder: KeyBuilder) -> str:
        return builder.render(self.args, self.kwargs, bound=self.bound)


def resolve_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Find the task a wrapper runs in: the ``self`` of a bind=True task, else the current task."""
    if args and isinstance(args[0], Task):
        task: Task = args[0]
        return Call(task=task, bound=True, args=args[1:], kwargs=kwargs, app=task.app)
    current = get_current_task()
    app = current.app if current is not None else current_app._get_current_object()
    return Call(task=current, bound=False, args=args, kwargs=kwargs, app=app)


def _requeues(request: Any) -> int:
    headers = getattr(request, "headers", None) or {}
    raw = headers.get(C.HEADER_LOCK_REQUEUES, getattr(request, C.HEADER_LOCK_REQUEUES, 0))
    try:
        return int(raw or 0)
    except (TypeError, ValueError):
        return 0


def requeue(call: Call, countdown: float, exc: SafeTimeError) -> NoReturn:
    """Send the same message again in ``countdown`` seconds and end this run as RETRY.

    Unlike ``Task.retry`` the retry count stays as it is (a header counts re-queues instead),
    so waiting for a lock never uses up the task's own ``max_retries``. Outside a worker
    (direct or eager calls) there is nothing to re-queue and ``exc`` is raised.
    """
    if not call.in_worker or call.task is None:
        raise exc
    task, request = call.task, call.request
    headers = dict(getattr(request, "headers", None) or {})
    headers[C.HEADER_LOCK_REQUEUES] = _requeues(request) + 1
    sig = task.signature_from_request(request, countdown=countdown, headers=headers)
    try:
        sig.apply_async()
    except Exception as publish_error:
        raise exc from publish_error
    raise Retry(exc=exc, when=countdown, sig=sig)


class HeldLock:
    """A lock this process holds around one task body.

    ``fence`` is the fencing number: pass it along with writes so the storage can reject a
    holder that has been superseded. :meth:`check` raises :class:`LockLost` once the watchdog
    failed to renew the lock.
    """

    def __init__(self, store: LockStore, key: str, token: str, fence: int, ttl: float, task_id: str) -> None:
        self.store = store
        self.key = key
        self.token = token
        self.fence = fence
        self.ttl = ttl
        self.task_id = task_id
        self.lost: str | None = None
        self._watchdog: Watchdog | None = None
        self._interrupter: Interrupter | None = None

    def check(self) -> None:
        if self.lost is not None:
            raise LockLost(f"overlap lock {self.key!r} lost: {self.lost}")

    def start(self, sender: Any, hard_deadline: float | None) -> None:
        self._interrupter = Interrupter()

        def lost(reason: str) -> None:
            self.lost = reason
            logger.error("overlap lock %r of task %s lost: %s", self.key, self.task_id, reason)
            signals.overlap_lock_lost.send(sender=sender, key=self.key, task_id=self.task_id)
            if self._interrupter is not None:
                self._interrupter.fire(LockLost)

        self._watchdog = Watchdog(
            lambda ttl: self.store.renew(self.key, self.token, ttl),
            lost,
            ttl=self.ttl,
            interval=self.ttl / 3.0,
            hard_deadline=hard_deadline,
            margin=C.LOCK_HARD_LIMIT_MARGIN,
        ).start()

    def stop(self) -> None:
        """Stop renewing and cancel a pending interrupt (the body has returned)."""
        if self._interrupter is not None:
            self._interrupter.disarm()
        if self._watchdog is not None:
            self._watchdog.stop()

    def release(self) -> bool:
        try:
            released = self.store.release(self.key, self.token)
        except redis.RedisError as exc:
            logger.warning("could not release overlap lock %r (it expires in %.0fs): %s", self.key, self.ttl, exc)
            return False
        if not released:
            logger.warning(
                "overlap lock %r had already expired or changed hands when task %s ended", self.key, self.task_id
            )
        return released


def acquire(
    store: LockStore, key: str, ttl: float, owner: Owner, deadline: float | None, marker: str | None = None
) -> tuple[Acquired, str]:
    """Run the acquire script; Redis errors become :class:`RedisUnavailable`."""
    token = uuid.uuid4().hex
    first_ttl = renewal_ttl(ttl, time.monotonic(), deadline, C.LOCK_HARD_LIMIT_MARGIN)
    try:
        return store.acquire(key, token, first_ttl, owner, marker=marker), token
    except (redis.RedisError, OSError) as exc:
        where = mask_url(store.config.redis_url)
        raise RedisUnavailable(f"cannot take overlap lock {key!r} (Redis {where}): {exc}") from exc


def run_holding(
    held: HeldLock,
    call: Call,
    body: Callable[[], R],
    deadline: float | None,
    on_success: Callable[[R], None] | None = None,
) -> R:
    """Run ``body`` while ``held`` is renewed; release it on every exit path Python sees.

    A hard time limit kills the process, so no ``finally`` runs: see :mod:`.hard_limit`.
    """
    request = call.request
    if request is not None:
        setattr(request, C.REQUEST_FENCE_ATTR, held.fence)
        setattr(request, C.REQUEST_LOCK_ATTR, held)
    held.start(call.task, deadline)
    committed = False
    try:
        try:
            try:
                result = body()
            finally:
                held.stop()
        except LockLost as exc:
            raise LockLost(f"overlap lock {held.key!r} lost while task {held.task_id} ran: {held.lost}") from exc
        held.check()
        if on_success is not None:
            on_success(result)
            committed = True
        return result
    finally:
        if not committed:
            held.release()


def send_conflict(call: Call, key: str, holder: str | None, action: str) -> None:
    signals.overlap_conflict.send(sender=call.task, key=key, task_id=call.task_id, holder=holder, action=action)


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


class TaskLock:
    """The lock one decorated function takes around its body (``overlap_lock``; ``idempotent`` extends it)."""

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
        """The key's marker says it already ran (only locks that pass a marker get here)."""


def wrap(func: F, lock: TaskLock) -> F:
    """Wrap ``func`` so every call runs through ``lock``; keeps its name and signature."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return lock(func, args, kwargs)

    # Celery checks call arguments against the task's signature; keep the real one.
    wrapper.__signature__ = lock.builder.signature  # type: ignore[attr-defined]
    wrapper.__safe_time_locks__ = (*getattr(func, "__safe_time_locks__", ()), lock)  # type: ignore[attr-defined]
    return cast(F, wrapper)
