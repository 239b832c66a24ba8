"""What ``overlap_lock`` and ``idempotent`` share: finding the running task, holding a lock
around the body (watchdog, fencing number, ``LockLost``) and re-queueing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import redis
from celery import Celery, Task, current_app
from celery._state import get_current_task
from celery.exceptions import Retry

from . import constants as C
from . import signals
from .exceptions import LockLost, RedisUnavailable, SafeTimeError
from .keys import KeyBuilder
from .lockstore import Acquired, LockStore, Owner
from .redis_client import mask_url
from .watchdog import Interrupter, Watchdog, renewal_ttl

logger = logging.getLogger(__name__)

R = TypeVar("R")

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


def jittered(retry_after: float, jitter: float, rand: Callable[[], float] = random.random) -> float:
    """``retry_after`` plus up to ``jitter`` seconds, so re-queued runs do not collide again."""
    return retry_after + jitter * rand()


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
