"""Hard time limits: the prefork pool kills the child, so no ``finally`` releases its lock.

Two things make up for it. In the child, a lock's lease is never renewed past the hard limit
plus :data:`~celery_safe_time.constants.LOCK_HARD_LIMIT_MARGIN` (see :func:`hard_deadline`). In
the worker's main process, a ``task_failure`` handler deletes the killed child's lock by its
token once the child is gone.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, Protocol

import redis
from celery import Celery, Task
from celery.exceptions import TimeLimitExceeded
from celery.signals import task_failure, worker_process_init

from .backends import LockBackend, get_lock_backend

logger = logging.getLogger(__name__)

#: After a hard time limit the worker's main process waits up to this long for the child to die
#: before it releases the child's lock (compare-and-delete on the child's token).
LOCK_KILLED_CHILD_WAIT = 5.0

_HOST = socket.gethostname()

_pool_child = False


def _mark_pool_child(**_: Any) -> None:
    global _pool_child
    _pool_child = True


def in_pool_child() -> bool:
    """Whether this process is a prefork pool process (``worker_process_init`` was sent in it)."""
    return _pool_child


class LockedCall(Protocol):
    """What :func:`hard_deadline` reads of a locked call (``runtime.Call`` has it): the running task,
    its request and its app. A protocol, so this module needs nothing of the runtime that imports it."""

    task: Task | None
    request: Any
    app: Celery


def hard_deadline(call: LockedCall, now: float) -> float | None:
    """Monotonic time at which the prefork pool kills this child (the hard time limit).

    Only prefork children are killed at the limit; other pools do not enforce it, and capping
    the lock there would take it away from a task that is still running.
    """
    if not _pool_child:
        return None
    request = call.request
    limits = getattr(request, "timelimit", None) if request is not None else None
    hard = limits[0] if limits else None
    if hard is None and call.task is not None:
        hard = getattr(call.task, "time_limit", None) or _app_time_limit(call.app)
    return now + float(hard) if hard else None


#: ``task_time_limit`` per app, read once: the pool takes its default limit from it when it starts,
#: and an ``app.conf`` lookup on every locked call costs tens of microseconds.
_app_limits: weakref.WeakKeyDictionary[Celery, float | None] = weakref.WeakKeyDictionary()


def _app_time_limit(app: Celery) -> float | None:
    try:
        return _app_limits[app]
    except KeyError:
        configured = app.conf.task_time_limit
        limit = _app_limits[app] = float(configured) if configured else None
        return limit


def locks_of(task: Task) -> tuple[Any, ...]:
    """The ``TaskLock`` objects the task's decorators wrap its body in, outermost last."""
    return tuple(getattr(task.run, "__safe_time_locks__", ()))


_handled: collections.deque[str] = collections.deque(maxlen=256)
_handled_lock = threading.Lock()


def _release_after_hard_limit(
    sender: Task | None = None, task_id: str | None = None, exception: BaseException | None = None, **signal: Any
) -> None:
    """``task_failure`` handler: after a hard time limit, free the killed child's lock.

    Celery sends it from the worker's main process just before the pool kills the child: the lock is
    read now (the child still holds it) and deleted by its token once the child is gone.
    """
    if sender is None or task_id is None or not isinstance(exception, TimeLimitExceeded):
        return
    bound = inspect.ismethod(sender.run)
    for lock in locks_of(sender):
        try:
            # A concurrency limit's call holds one of several slot keys: each is a lock of its own.
            keys = lock.held_keys_for(tuple(signal.get("args") or ()), dict(signal.get("kwargs") or {}), bound=bound)
            store = get_lock_backend(sender.app)
        except Exception as exc:
            logger.warning("cannot free the lock of %s[%s] after its hard time limit: %s", sender.name, task_id, exc)
            continue
        for key in keys:
            _release_key_after_hard_limit(store, key, task_id, sender.name)


def _release_key_after_hard_limit(store: Any, key: str, task_id: str, task_name: str) -> None:
    """Free ``key`` once the killed child is gone, if that child (``task_id`` in this host's pool) holds it."""
    try:
        record = store.holder_record(key)
    except Exception as exc:
        logger.warning("cannot free the lock of %s[%s] after its hard time limit: %s", task_name, task_id, exc)
        return
    if record is None:
        return
    token, holder, host, pid = record
    if token is None or holder != task_id or host != _HOST or pid is None or pid == os.getpid():
        return
    # Celery 5.7 sends task_failure twice for one hard time limit (pool callback and request).
    with _handled_lock:
        if token in _handled:
            return
        _handled.append(token)
    threading.Thread(
        target=_release_when_dead,
        args=(store, key, token, pid, task_id),
        name="safe-time-hard-limit-release",
        daemon=True,
    ).start()


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # A zombie has exited; its parent just has not reaped it yet.
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _release_when_dead(store: LockBackend, key: str, token: str, pid: int, task_id: str) -> None:
    deadline = time.monotonic() + LOCK_KILLED_CHILD_WAIT
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            logger.warning("pool child %s still alive; overlap lock %r of %s will expire on its own", pid, key, task_id)
            return
        time.sleep(0.05)
    try:
        if store.release(key, token):
            logger.info("released overlap lock %r of %s after its hard time limit killed pid %s", key, task_id, pid)
        else:
            logger.info("overlap lock %r of %s was already free after its hard time limit", key, task_id)
    except (redis.RedisError, OSError) as exc:
        logger.warning("could not release overlap lock %r on %s after a hard time limit: %s", key, store.label, exc)


task_failure.connect(_release_after_hard_limit, weak=False, dispatch_uid="celery_safe_time.hard_limit.release")
worker_process_init.connect(_mark_pool_child, weak=False, dispatch_uid="celery_safe_time.hard_limit.pool_child")
