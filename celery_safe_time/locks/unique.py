"""Unique tasks at enqueue: while a key is held, ``delay()`` hands back the holder instead of queuing a
copy (``SafeTask(unique=..., unique_until=..., unique_ttl=...)``; docs/locks.md).

The key ``<prefix>unique:<key>`` lives on the lock backend (a Redis hash, a ``safe_time_unique`` row,
a dict entry) and expires after ``unique_ttl`` unless released first; ``unique_acquire`` and
``unique_release`` are its only writes. Besides the run itself (by ``unique_until``), a copy that
never runs frees it: ``task_revoked``, a stored row's cancel, and a hard time limit or lost pool child
seen by the worker's main process (``task_failure``). A stored holder whose row has ended is taken
over (compare-and-swap on its task id); ``retry()`` refreshes the key (``retrying``) instead of
conflicting with it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import redis
from celery import Celery, Task
from celery.exceptions import Reject, Retry, TimeLimitExceeded, WorkerLostError
from celery.signals import task_failure, task_revoked

from .. import constants as C
from .. import handoff
from ..exceptions import UniqueConflict
from .backends import LockBackend, UniqueClaim, get_lock_backend
from .entry_runs import overlap_spec
from .keys import KeyBuilder, KeySpec
from .runtime import AdmissionWatch, is_gated

logger = logging.getLogger(__name__)

R = TypeVar("R")

__all__ = ["UniqueSpec", "release_stored", "run_unique", "unique_spec"]

_HOST = socket.gethostname()

#: The class attribute a SafeTask subclass keeps its bound unique spec in.
SPEC_ATTR = "_safe_time_unique"


@dataclasses.dataclass(frozen=True)
class UniqueSpec:
    """A task's ``unique=`` options, bound to its function's signature."""

    builder: KeyBuilder
    bound: bool
    until: str
    ttl: float
    on_conflict: str

    def render(self, args: Any, kwargs: Any) -> str:
        return self.builder.render(tuple(args or ()), dict(kwargs or {}), bound=self.bound)


def unique_spec(
    task_name: str, run: Any, key: KeySpec | None, until: Any, ttl: Any, on_conflict: Any
) -> UniqueSpec | None:
    """Check a task's unique options and bind the key template to ``run``; None without ``unique=``.

    ``run`` is the class attribute: a ``staticmethod`` (plain task) or a function whose first
    parameter is the task (``bind=True`` or a ``run`` method). Raises ``ValueError``/``TypeError``
    naming the option.
    """
    if key is None:
        return None
    if until not in C.UNIQUE_UNTIL_MODES:
        modes = ", ".join(C.UNIQUE_UNTIL_MODES)
        raise ValueError(f"task {task_name}: unique_until must be one of {modes}, got {until!r}")
    if on_conflict not in C.UNIQUE_ON_CONFLICT_POLICIES:
        raise ValueError(
            f"task {task_name}: unique_on_conflict must be one of {', '.join(C.UNIQUE_ON_CONFLICT_POLICIES)}, "
            f"got {on_conflict!r}"
        )
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
        raise ValueError(f"task {task_name}: unique_ttl must be a positive number of seconds, got {ttl!r}")
    bound = not isinstance(run, staticmethod)
    func = run.__func__ if isinstance(run, staticmethod) else run
    try:
        builder = KeyBuilder(func, key)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"task {task_name}: unique={key!r}: {exc}") from None
    return UniqueSpec(builder=builder, bound=bound, until=until, ttl=float(ttl), on_conflict=on_conflict)


def spec_of(task: Task) -> UniqueSpec | None:
    spec = getattr(type(task), SPEC_ATTR, None)
    return spec if isinstance(spec, UniqueSpec) else None


# --- the caller's side ---------------------------------------------------------------------------


def _holder_gone(app: Celery, claim: UniqueClaim) -> bool:
    """Whether a held key's holder can be seen to be gone: only a stored holder's row can say so."""
    if not claim.stored or claim.holder is None:
        return False
    return handoff.stored_run_ended(app, claim.holder)


def claim(
    app: Celery,
    key: str,
    task_id: str,
    ttl: float,
    *,
    stored: bool,
    own: bool,
) -> UniqueClaim:
    """Take ``key`` for ``task_id`` (replacing a stored holder that is gone). A lock backend that cannot be
    reached raises :class:`~celery_safe_time.exceptions.CoordinationUnavailable` at the call site
    (``RedisUnavailable`` on Redis): nothing was published."""
    store = get_lock_backend(app)
    state = C.UNIQUE_STATE_RETRYING if own else (C.UNIQUE_STATE_STORED if stored else C.UNIQUE_STATE_QUEUED)
    gone: str | None = None
    try:
        while True:
            found = store.unique_acquire(key, task_id, ttl, state, stored=stored, host=_HOST, gone=gone, own=own)
            if found.status != "held" or found.holder == task_id or found.holder == gone:
                return found
            if not _holder_gone(app, found):
                return found
            logger.info("unique key %r: holder %s has ended in the store, taking the key over", key, found.holder)
            gone = found.holder
    except (redis.RedisError, OSError) as exc:
        raise store.unavailable(f"cannot take unique key {key!r} ({store.describe()}): {exc}") from exc


def repoint(app: Celery, key: str, from_task: str, to_task: str, ttl: float) -> None:
    """The store already had a pending row for the key (the lock backend had forgotten it): the key names
    that row."""
    store = get_lock_backend(app)
    try:
        store.unique_acquire(key, to_task, ttl, C.UNIQUE_STATE_STORED, stored=True, host=_HOST, gone=from_task)
    except (redis.RedisError, OSError) as exc:
        logger.warning("could not point unique key %r on %s at stored task %s: %s", key, store.label, to_task, exc)


def conflict(task: Task, spec: UniqueSpec, key: str, holder: str, state: str | None) -> Any:
    """``unique_on_conflict``: the holder's AsyncResult, or :class:`UniqueConflict`."""
    from .. import signals

    logger.debug("unique key %r held by %s (%s): not queuing %s", key, holder, state, task.name)
    signals.unique_conflict.send(sender=task, key=key, task_id=holder, state=state)
    if spec.on_conflict == "raise":
        raise UniqueConflict(key, holder, state)
    return task.AsyncResult(holder)


def release(store: LockBackend, key: str, task_id: str, why: str) -> bool:
    try:
        released = store.unique_release(key, task_id)
    except (redis.RedisError, OSError) as exc:
        logger.warning(
            "could not release unique key %r of %s on %s (%s; it expires on its own): %s",
            key,
            task_id,
            store.label,
            why,
            exc,
        )
        return False
    if released:
        logger.debug("released unique key %r of %s: %s", key, task_id, why)
    return released


# --- the worker's side ---------------------------------------------------------------------------


def header_key(request: Any) -> str | None:
    headers = getattr(request, "headers", None) or {}
    value = headers.get(C.HEADER_UNIQUE, getattr(request, C.HEADER_UNIQUE, None))
    return str(value) if value else None


def run_unique(task: Task, body: Callable[[], R]) -> R:
    """Run one started delivery of a unique task: free or refresh its key as ``unique_until`` says."""
    request = task.request
    key = header_key(request)
    spec = spec_of(task)
    if key is None or spec is None or spec.until == C.UNIQUE_UNTIL_EXPIRED:
        return body()
    store = get_lock_backend(task._get_app())
    task_id = str(request.id)
    if spec.until == C.UNIQUE_UNTIL_EXECUTING:
        if not is_gated(task.run) and overlap_spec(request) is None:
            release(store, key, task_id, "started")
            return body()
        return _run_admitted(request, store, key, task_id, body)
    try:
        # Counted again from the start: a kill -9 now frees the key unique_ttl later.
        store.unique_acquire(key, task_id, spec.ttl, C.UNIQUE_STATE_RUNNING, stored=None, host=_HOST, own=True)
    except (redis.RedisError, OSError) as exc:
        logger.warning("could not mark unique key %r of %s running on %s: %s", key, task_id, store.label, exc)
    keep = False
    try:
        return body()
    except Retry:
        keep = True  # the retry's publish refreshed the key for the next attempt
        raise
    except Reject as exc:
        keep = bool(exc.requeue)  # the same message comes back
        raise
    finally:
        if not keep:
            release(store, key, task_id, "ended")


def _run_admitted(request: Any, store: LockBackend, key: str, task_id: str, body: Callable[[], R]) -> R:
    """``unique_until="executing"`` behind gates: the key is freed once every gate admitted the run, not
    before (a gate that sends the delivery back re-queues it under the key it still holds, so no call
    in between queues a second copy); a delivery a gate skipped or failed frees it at its end."""
    watch = AdmissionWatch(lambda: release(store, key, task_id, "started"))
    setattr(request, C.REQUEST_ADMISSION_WATCH_ATTR, watch)
    try:
        return body()
    finally:
        vars(request).pop(C.REQUEST_ADMISSION_WATCH_ATTR, None)
        # A waiting delivery comes back under the key; a dropped copy's original holds it or freed it.
        if not watch.admitted and watch.outcome not in (C.ADMISSION_WAITING, C.ADMISSION_DUPLICATE):
            release(store, key, task_id, "not run")


def _release_revoked(sender: Task | None = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """``task_revoked`` (worker main process): a revoked or expired message never runs; free its key."""
    task = sender if isinstance(sender, Task) else getattr(request, "task", None)
    if not isinstance(task, Task) or spec_of(task) is None or request is None:
        return
    key = header_key(request)
    task_id = getattr(request, "id", None)
    if not key or not task_id:
        return
    release(get_lock_backend(task._get_app()), key, str(task_id), "expired" if expired else "revoked")


def _release_killed(
    sender: Task | None = None, task_id: str | None = None, exception: BaseException | None = None, **signal: Any
) -> None:
    """``task_failure`` for a hard time limit or a lost pool child: no ``finally`` ran in the child."""
    if sender is None or task_id is None or not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        return
    spec = spec_of(sender)
    if spec is None or spec.until == C.UNIQUE_UNTIL_EXPIRED:
        return
    if isinstance(exception, WorkerLostError) and _comes_back(sender):
        return  # the message is redelivered and runs again under the same key
    try:
        key = spec.render(signal.get("args"), signal.get("kwargs"))
    except TypeError as exc:
        logger.warning("cannot free the unique key of %s[%s]: %s", sender.name, task_id, exc)
        return
    release(get_lock_backend(sender._get_app()), key, task_id, exception.__class__.__name__)


def _comes_back(task: Task) -> bool:
    """Whether the worker requeues a message whose pool child died (acks_late + reject_on_worker_lost)."""
    conf = task._get_app().conf
    acks_late = task.acks_late if task.acks_late is not None else conf.task_acks_late
    reject = task.reject_on_worker_lost if task.reject_on_worker_lost is not None else conf.task_reject_on_worker_lost
    return bool(acks_late and reject)


def release_stored(app: Celery, task_id: str, payload_headers: Mapping[str, Any] | None) -> None:
    """A stored row was cancelled: free the unique key it held."""
    key = (payload_headers or {}).get(C.HEADER_UNIQUE)
    if key:
        release(get_lock_backend(app), str(key), task_id, "cancelled")


task_revoked.connect(_release_revoked, weak=False, dispatch_uid="celery_safe_time.unique.revoked")
task_failure.connect(_release_killed, weak=False, dispatch_uid="celery_safe_time.unique.killed")
