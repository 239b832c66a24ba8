"""Keeps a held lock alive while its task runs, and tells the task when it cannot.

:class:`Watchdog` renews the lock every ``ttl/3``; one daemon thread per process schedules the
renewals and each runs on a small pool of daemon threads (:class:`_Calls`), so a renewal that hangs
(a stalled connection, a server that stopped answering) holds up only itself. When a renewal is
refused (the lock expired or someone else holds it now), or no renewal succeeded and none can any
more before the lock would expire (errors, or a call still unanswered at that point), it calls
``on_lost`` once and stops. :class:`Interrupter` then raises
:class:`~celery_safe_time.exceptions.LockLost` inside the task's thread, so the task does not run on
silently without its lock.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable

import redis

from .concurrency import green_threads

logger = logging.getLogger(__name__)

#: At most this many lock renewals of one process run at once, each on a daemon thread of its own
#: (started when needed, kept idle after): a renewal that hangs holds up only itself.
LOCK_RENEWAL_THREADS = 16


def renewal_ttl(ttl: float, now: float, hard_deadline: float | None, margin: float) -> float:
    """The ttl to ask for at ``now``: never past the task's hard time limit plus ``margin``.

    A hard time limit kills the pool child without running any ``finally``; capping the lock
    there means it frees itself about ``margin`` seconds after the kill instead of ``ttl``.
    """
    if hard_deadline is None:
        return ttl
    return max(0.001, min(ttl, hard_deadline - now + margin))


def retry_gap(ttl: float, interval: float) -> float:
    """How soon to try again after a failed renewal: several tries fit before the lock expires."""
    return max(0.05, min(interval, ttl / 10.0))


class Watchdog:
    """Renews one lock until :meth:`stop`; calls ``on_lost(reason)`` at most once.

    All watchdogs of a process share one scheduling thread (:class:`_Renewer`) and a pool of call
    threads, so taking a lock costs no thread start and releasing it no join: the per-task overhead
    stays at the two round trips of acquire and release.
    """

    def __init__(
        self,
        renew: Callable[[float], bool],
        on_lost: Callable[[str], None],
        *,
        ttl: float,
        interval: float,
        hard_deadline: float | None = None,
        margin: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._renew = renew
        self._on_lost = on_lost
        self.ttl = ttl
        self.interval = interval
        self.hard_deadline = hard_deadline
        self.margin = margin
        self._clock = clock
        self._mutex = threading.Lock()
        self.stopped = False
        self.last_ok = 0.0
        self.due = 0.0
        #: Set while a renewal runs on a call thread (the renewer then watches :attr:`gives_up_at`).
        self.in_flight = False
        self._renewer: _Renewer | None = None

    @property
    def gives_up_at(self) -> float:
        """When an unanswered renewal is given up and the lock reported lost: a retry gap before the
        lease the last successful renewal asked for ends, so the task hears of it before anyone else
        can take the lock."""
        return self.last_ok + self.ttl - retry_gap(self.ttl, self.interval)

    def start(self, leased_at: float | None = None) -> Watchdog:
        """Start renewing a lease taken at ``leased_at`` (on ``clock``: when its acquire was sent,
        which the lease runs from), or now."""
        self.last_ok = self._clock() if leased_at is None else leased_at
        self.due = self.last_ok + self.interval
        self._renewer = _renewer()
        self._renewer.add(self)
        return self

    def stop(self) -> None:
        # Under the mutex, which every report takes: nothing is reported after this returns. A
        # renewal still in flight may reach the server later; it compares the token, so it cannot
        # extend a lock released (or taken by another holder) meanwhile.
        with self._mutex:
            self.stopped = True
        renewer = self._renewer
        if renewer is not None:
            renewer.discard(self)

    def tick(self) -> None:
        """Renew now and set the next :attr:`due` (run on a call thread when due, or directly)."""
        with self._mutex:
            if self.stopped:
                return
            asked_at = self._clock()
            ttl = renewal_ttl(self.ttl, asked_at, self.hard_deadline, self.margin)
        # Not under the mutex: a call that hangs must not hold up stop() (the task returning) or the
        # renewer giving it up (expire()).
        try:
            ok = self._renew(ttl)
            error: Exception | None = None
        except Exception as exc:  # Redis/database errors mostly; anything else must not kill the thread
            ok, error = False, exc
        with self._mutex:
            if self.stopped:
                return
            now = self._clock()
            if error is not None:
                gap = retry_gap(self.ttl, self.interval)
                if now + gap - self.last_ok >= self.ttl:
                    reason = f"the lock store unreachable for {now - self.last_ok:.1f}s, the lock has expired: {error}"
                    self._lost(reason)
                    return
                log = logger.warning if isinstance(error, (redis.RedisError, OSError)) else logger.exception
                log("overlap lock renewal failed, retrying in %.2fs: %s", gap, error)
                self.due = now + gap
                return
            if not ok:
                self._lost("the lock expired or is held by someone else")
                return
            self.last_ok = asked_at  # the lease runs from when the renewal was sent, at the latest
            self.due = max(now, asked_at + self.interval)

    def expire(self) -> None:
        """Report the lock lost if a renewal is still unanswered at :attr:`gives_up_at` (renewer thread)."""
        with self._mutex:
            if self.stopped or self._clock() < self.gives_up_at:
                return
            waited = self._clock() - self.last_ok
            self._lost(f"the lock store unreachable: no renewal answered for {waited:.1f}s, the lock expires")

    def _lost(self, reason: str) -> None:
        self.stopped = True
        try:
            self._on_lost(reason)
        except Exception:
            logger.exception("overlap lock lost handler failed")


class _Calls:
    """Daemon threads that run renewals: one more is started when none is idle (up to ``limit``),
    and idle ones wait for the next call. A renewal that hangs holds one of them, not the others."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._waiting = 0

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            self._waiting += 1
            spawn = self._waiting > self._idle and self._threads < self.limit
            if spawn:
                self._threads += 1
        self._queue.put(call)
        if spawn:
            threading.Thread(target=self._work, name="safe-time-lock-renewal", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            call = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._waiting -= 1
            try:
                call()
            except Exception:
                logger.exception("an overlap lock renewal failed")


class _Renewer:
    """One daemon thread per process that sends every registered :class:`Watchdog`'s renewal to the
    call threads when due, and gives up a renewal still unanswered when its lock would expire."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # add() and discard() take the plain lock under the condition: Condition's own
        # __enter__/__exit__ are two more Python calls on every locked task.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._watchdogs: set[Watchdog] = set()
        self._wake_at = math.inf
        #: With no lock to renew the thread still wakes this often: the shortest renewal interval seen
        #: here. A lock taken next is then first due after that wake-up, so taking it needs no notify:
        #: waking this thread on every acquire would cost a context switch (and the GIL) per locked task.
        self._idle_wait = math.inf
        self._calls = _Calls(LOCK_RENEWAL_THREADS)
        self._thread = threading.Thread(target=self._run, name="safe-time-lock-renewer", daemon=True)
        self._thread.start()

    def add(self, watchdog: Watchdog) -> None:
        with self._mutex:
            self._watchdogs.add(watchdog)
            self._idle_wait = min(self._idle_wait, watchdog.interval)
            # Only wake the thread when it would sleep past this lock's first renewal; in steady
            # state (and when idle, see _idle_wait) it is already due to wake earlier, so taking a
            # lock costs no context switch.
            if watchdog.due < self._wake_at:
                self._cond.notify()

    def discard(self, watchdog: Watchdog) -> None:
        with self._mutex:
            self._watchdogs.discard(watchdog)

    def _renew(self, watchdog: Watchdog) -> None:
        """On a call thread: one renewal, then back to the schedule."""
        try:
            watchdog.tick()
        finally:
            with self._mutex:
                watchdog.in_flight = False
                if watchdog.stopped:
                    self._watchdogs.discard(watchdog)
                elif watchdog.due < self._wake_at:
                    self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due: list[Watchdog] = []
                overdue: list[Watchdog] = []
                wake_at = now + self._idle_wait
                for w in self._watchdogs:
                    if w.in_flight:
                        if w.gives_up_at <= now:
                            overdue.append(w)
                        else:
                            wake_at = min(wake_at, w.gives_up_at)
                    elif w.due <= now:
                        w.in_flight = True
                        due.append(w)
                    else:
                        wake_at = min(wake_at, w.due)
                if not due and not overdue:
                    self._wake_at = wake_at
                    self._cond.wait(None if wake_at == math.inf else wake_at - now)
                    continue
                self._wake_at = now
            for watchdog in due:
                self._calls.submit(lambda w=watchdog: self._renew(w))  # type: ignore[misc]
            for watchdog in overdue:
                # Reports it lost unless the renewal answered meanwhile (then it stays scheduled); its
                # call thread may stay stuck until the call's own deadline.
                watchdog.expire()
                if watchdog.stopped:
                    self.discard(watchdog)


_renewer_instance: _Renewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> _Renewer:
    global _renewer_instance
    renewer = _renewer_instance
    if renewer is None or renewer.pid != os.getpid():  # a forked child has no thread: start its own
        with _renewer_lock:
            renewer = _renewer_instance
            if renewer is None or renewer.pid != os.getpid():
                renewer = _renewer_instance = _Renewer()
    return renewer


class Interrupter:
    """Raises an exception type asynchronously in one thread, only while it is armed.

    The exception is delivered at the thread's next Python bytecode, so a blocking C call
    (a socket read, ``time.sleep``) finishes first. :meth:`disarm` cancels a pending one, so it
    can never surface in Celery's code after the task body returned.
    """

    def __init__(self, thread_id: int | None = None) -> None:
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.enabled = not green_threads()
        self._mutex = threading.Lock()
        self._armed = True
        self.fired = False

    def fire(self, exc_type: type[BaseException]) -> bool:
        with self._mutex:
            if not (self._armed and self.enabled) or self.fired:
                return False
            done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread_id), ctypes.py_object(exc_type)
            )
            self.fired = done == 1
            return self.fired

    def disarm(self) -> None:
        with self._mutex:
            self._armed = False
            if self.fired:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
