"""The worker side of a beat entry's overlap policy: one run of the entry at a time, across workers.

A message beat marked with the ``safe_time_overlap`` header (:mod:`..beat.overlap`) runs under the
entry's run lease, the overlap lock ``beat-entry:{entry}``. One that finds it held is dropped
(``skip``) or re-queued to look again every ``OVERLAP_RETRY_AFTER`` seconds (``buffer_*``,
``cancel_other``), keeping its queued marker (a unique key beat took when it published) alive; the
marker is released once the run holds the lease. ``buffer_all`` gives each run a marker of its own
and names the run before it (``after``), so runs start in slot order.

:func:`install_worker` wraps the ``run`` of every task of the app (a message without the header goes
straight through); :func:`cancellable` turns ``cancel_other``'s SIGTERM into
:class:`~celery_safe_time.exceptions.RunCancelled` inside the body; :func:`on_revoked` frees the queued
marker of a revoked message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import signal
import socket
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis
from celery import Celery, Task

from .. import constants as C
from .. import handoff
from ..exceptions import RunCancelled
from ..messages.requeue import message_header
from .backends import Holder, LockBackend, get_lock_backend
from .hard_limit import in_pool_child
from .runtime import Call, Policy, TaskLock, admission_of, admitted_first, is_gated, run_holding

logger = logging.getLogger(__name__)

#: How often (seconds, at most) a run waiting for its entry's lease looks again (``buffer_*``,
#: ``cancel_other``); a third of the lease's ttl when that is shorter.
OVERLAP_RETRY_AFTER = 1.0

__all__ = ["Spec", "entry_key", "install_worker", "last_key", "on_revoked", "overlap_spec", "release_marker", "run_key"]

_HOST = socket.gethostname()
#: Marks a task whose ``run`` this module has wrapped (``install_worker`` is idempotent).
_WRAPPED_ATTR = "__safe_time_entry_runs__"


def entry_key(entry: str) -> str:
    """The run lease and queued-marker key of the beat entry ``entry``."""
    return C.OVERLAP_ENTRY_KEY.format(entry=entry)


def run_key(entry: str, task_id: str) -> str:
    """The queued marker of one ``buffer_all`` run of ``entry`` (each waiting run has its own)."""
    return C.OVERLAP_RUN_KEY.format(entry=entry, task_id=task_id)


def last_key(entry: str) -> str:
    """Names the last ``buffer_all`` run beat published for ``entry`` (the next one runs after it)."""
    return C.OVERLAP_LAST_KEY.format(entry=entry)


def retry_after(ttl: float) -> float:
    """How often a run waiting for a lease of ``ttl`` seconds looks again."""
    return min(OVERLAP_RETRY_AFTER, ttl / 3.0)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The ``safe_time_overlap`` header of one run: its entry, policy, lease ttl, and for
    ``buffer_all`` the task id of the run published before it (None: none waiting)."""

    entry: str
    policy: str
    ttl: float
    after: str | None = None

    def marker(self, task_id: str) -> str:
        """This run's queued marker: its own for ``buffer_all``, else the entry's one."""
        return run_key(self.entry, task_id) if self.policy == "buffer_all" else entry_key(self.entry)


def overlap_spec(request: Any) -> Spec | None:
    """The ``safe_time_overlap`` header of ``request``, or None."""
    spec = message_header(request, C.HEADER_OVERLAP)
    if not isinstance(spec, Mapping):
        return None
    entry, policy, ttl, after = spec.get("entry"), spec.get("policy"), spec.get("ttl"), spec.get("after")
    if not isinstance(entry, str) or policy not in C.OVERLAP_POLICIES or policy == "allow":
        return None
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not ttl > 0:
        return None
    return Spec(entry, str(policy), float(ttl), after if isinstance(after, str) and after else None)


class EntryPolicy(Policy):
    """``on_conflict`` of a beat entry's run: ``skip`` drops it, the others wait (re-queue)."""

    def __init__(self, spec: Spec, marker: str) -> None:
        wait = retry_after(spec.ttl)
        super().__init__(
            ttl=spec.ttl,
            on_conflict="skip" if spec.policy == "skip" else "retry",
            retry_after=wait,
            jitter=wait / 4.0,
            on_backend_error="retry",
        )
        self.spec = spec
        self.marker = marker

    def conflict(self, call: Call, key: str, holder: Holder | None) -> None:
        store = get_lock_backend(call.app)
        task_id = call.task_id or ""
        marker = self.marker
        if self.on_conflict == "skip":
            logger.info(
                "beat entry %r: dropping run %s (overlap skip): a run is in progress (%s)",
                self.spec.entry,
                task_id,
                holder.describe() if holder is not None else "?",
            )
            _quietly(store, lambda: store.unique_release(marker, task_id))
        else:
            self.keep_queued(store, task_id)
        super().conflict(call, key, holder)

    def keep_queued(self, store: LockBackend, task_id: str) -> None:
        """Keep a run that waits counted as queued (beat reads the marker; the next ``buffer_all``
        run waits for it)."""
        ttl = self.spec.ttl + self.retry_after
        _quietly(
            store,
            lambda: store.unique_acquire(self.marker, task_id, ttl, "waiting", stored=False, host=_HOST, own=True),
        )


class EntryLock(TaskLock):
    """The run lease of one beat entry (no key template: the key is the entry's)."""

    policy: EntryPolicy

    def __init__(self, spec: Spec, marker: str) -> None:
        self.policy = EntryPolicy(spec, marker)
        self.key = entry_key(spec.entry)


def run_gated(task: Task, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``run`` holding its beat entry's lease when the message carries ``safe_time_overlap``."""
    request = task.request
    spec = overlap_spec(request)
    if spec is None:
        return run(*args, **kwargs)
    if not is_gated(run):
        run = admitted_first(run)
    call = Call(task, False, args, kwargs, task._get_app())
    task_id = call.task_id
    if not call.in_worker or not task_id:
        return run(*args, **kwargs)
    # The entry's lease is the delivery's first gate: a stored wait's delivery (a row an inner gate
    # stored) is checked against its row before it, so whatever the lease does with the copy (sends
    # it back, drops it as already run) ends the row too (see handoff.checked_delivery).
    return handoff.checked_delivery(lambda: _run_leased(call, spec, task_id, run, args, kwargs))


def _run_leased(
    call: Call, spec: Spec, task_id: str, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """:func:`run_gated` once the delivery may start: ``run`` under the entry's lease, or not at all."""
    marker = spec.marker(task_id)
    lock = EntryLock(spec, marker)
    if spec.after is not None and _waiting(call, spec.after, spec.entry):
        # buffer_all keeps the slots' order: the run published before this one has not started.
        lock.policy.conflict(call, lock.key, None)
        return None
    taken = lock.take(call, lock.key)
    if taken is None:
        return None
    held, deadline = taken
    store = held.store
    # Running now: no longer queued (beat reads "running" from the lease from here on).
    _quietly(store, lambda: store.unique_release(marker, task_id))
    logger.debug("beat entry %r: run %s holds its lease (fence %s)", spec.entry, task_id, held.fence)
    try:
        with cancellable(spec.entry, task_id):
            return run_holding(held, call, lambda: run(*args, **kwargs), deadline)
    finally:
        if admission_of(call.request) == C.ADMISSION_WAITING:
            # A gate inside re-queued the run before its body ran: it is queued again (beat reads
            # "queued" from the marker; buffer_one publishes no second waiting run beside it).
            lock.policy.keep_queued(store, task_id)


@contextlib.contextmanager
def cancellable(entry: str, task_id: str) -> Iterator[None]:
    """While a run holds its lease in a prefork pool process, SIGTERM (``cancel_other``'s
    ``revoke(terminate=True)``) raises :class:`RunCancelled` in it instead of killing the process:
    the body unwinds and its ``finally`` releases the lease, so the newer run starts at once, and
    never while this one still runs. A body that swallows the exception keeps running and keeps
    the lease (the newer run waits): the cancel is cooperative. Elsewhere (threads, solo, eager)
    nothing is installed."""
    if not in_pool_child() or threading.current_thread() is not threading.main_thread():
        yield
        return

    def cancel(signum: int, frame: Any) -> None:
        logger.warning("beat entry %r: run %s is cancelled by a newer run (overlap cancel_other)", entry, task_id)
        raise RunCancelled(f"beat entry {entry!r}: run {task_id} was cancelled by a newer run (overlap cancel_other)")

    previous = signal.signal(signal.SIGTERM, cancel)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _waiting(call: Call, before: str, entry: str) -> bool:
    """Whether the ``buffer_all`` run ``before`` still waits (its marker lives until it starts,
    or expires when its message was lost). Unreachable: no (the lease then decides)."""
    store = get_lock_backend(call.app)
    try:
        return store.unique_info(run_key(entry, before), time.time()) is not None
    except (redis.RedisError, OSError):
        return False


def _quietly(store: LockBackend, action: Callable[[], Any]) -> None:
    """A best-effort marker update: the marker expires by itself, the lease keeps runs apart."""
    try:
        action()
    except (redis.RedisError, OSError) as exc:
        logger.warning("could not update a beat entry's queued marker on %s: %s", store.label, exc)


def wrap_task(task: Task) -> None:
    """Route ``task``'s runs through :func:`run_gated` (an instance attribute: ``Task.__call__`` and
    the worker's tracer both call ``task.run``). A bound ``run`` stays a bound method, with the
    attributes of the function it wraps (the lock decorators' ``__safe_time_locks__``: the
    hard-time-limit release reads them, and whether ``run`` is bound)."""
    if getattr(task, _WRAPPED_ATTR, False):
        return
    run = task.run
    if inspect.ismethod(run):

        @functools.wraps(run.__func__)
        def gated_method(self: Task, *args: Any, **kwargs: Any) -> Any:
            return run_gated(self, run, args, kwargs)

        task.run = types.MethodType(gated_method, task)
    else:

        @functools.wraps(run)
        def gated(*args: Any, **kwargs: Any) -> Any:
            return run_gated(task, run, args, kwargs)

        task.run = gated
    setattr(task, _WRAPPED_ATTR, True)


def install_worker(app: Celery) -> None:
    """Wrap every task of ``app`` (``worker_init``: before the worker builds its tracers and forks)."""
    for task in list(app.tasks.values()):
        wrap_task(task)


def release_marker(app: Celery, request: Any) -> None:
    """Free the queued marker ``request``'s run holds (a revoked message never runs)."""
    spec = overlap_spec(request)
    task_id = getattr(request, "id", None)
    if spec is None or not task_id:
        return
    store = get_lock_backend(app)
    marker = spec.marker(str(task_id))
    _quietly(store, lambda: store.unique_release(marker, str(task_id)))


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_revoked`` (worker main process): a revoked queued run never runs; free its marker.

    A terminated running run is not freed here: its process may still be unwinding (or ignoring
    the signal), and its own ``finally`` (or its lease's expiry) frees the entry."""
    task = sender if isinstance(sender, Task) else getattr(request, "task", None)
    if isinstance(task, Task) and request is not None:
        release_marker(task._get_app(), request)
