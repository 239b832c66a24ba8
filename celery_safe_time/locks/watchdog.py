"""Keeps a held lock alive while its task runs, and tells the task when it cannot.

:class:`Watchdog` renews the lock every ``ttl/3`` from a daemon thread shared by the process. When a renewal is
refused (the lock expired or someone else holds it now) or Redis stays unreachable until the
lock would have expired, it calls ``on_lost`` once and stops. :class:`Interrupter` then raises
:class:`~celery_safe_time.exceptions.LockLost` inside the task's thread, so the task does not
run on silently without its lock.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from collections.abc import Callable

import redis

from ..concurrency import green_threads

logger = logging.getLogger(__name__)


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

    All watchdogs of a process share one daemon thread (:class:`_Renewer`), so taking a lock
    costs no thread start and releasing it no join: the per-task overhead stays at the two
    Redis round trips of acquire and release.
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
        self.renewals = 0
        self.last_ok = 0.0
        self.due = 0.0
        self._renewer: _Renewer | None = None

    def start(self) -> Watchdog:
        self.last_ok = self._clock()
        self.due = self.last_ok + self.interval
        self._renewer = _renewer()
        self._renewer.add(self)
        return self

    def stop(self) -> None:
        # Waits for a renewal in flight, so nothing renews (or reports) after this returns.
        with self._mutex:
            self.stopped = True
        renewer = self._renewer
        if renewer is not None:
            renewer.discard(self)

    def tick(self) -> None:
        """Renew now (called by the shared thread when :attr:`due`); sets the next :attr:`due`."""
        with self._mutex:
            if self.stopped:
                return
            now = self._clock()
            try:
                ok = self._renew(renewal_ttl(self.ttl, now, self.hard_deadline, self.margin))
            except Exception as exc:  # Redis errors mostly; anything else must not kill the shared thread
                gap = retry_gap(self.ttl, self.interval)
                if now + gap - self.last_ok >= self.ttl:
                    self._lost(f"Redis unreachable for {now - self.last_ok:.1f}s, the lock has expired: {exc}")
                    return
                log = logger.warning if isinstance(exc, (redis.RedisError, OSError)) else logger.exception
                log("overlap lock renewal failed, retrying in %.2fs: %s", gap, exc)
                self.due = now + gap
                return
            if not ok:
                self._lost("the lock expired or is held by someone else")
                return
            self.renewals += 1
            self.last_ok = now
            self.due = now + self.interval

    def _lost(self, reason: str) -> None:
        self.stopped = True
        try:
            self._on_lost(reason)
        except Exception:
            logger.exception("overlap lock lost handler failed")


class _Renewer:
    """One daemon thread per process that ticks every registered :class:`Watchdog` when due."""

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
        #: waking this thread on every acquire cost a context switch (and the GIL) per locked task.
        self._idle_wait = math.inf
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

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [w for w in self._watchdogs if w.due <= now]
                if not due:
                    self._wake_at = min((w.due for w in self._watchdogs), default=now + self._idle_wait)
                    self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    continue
                self._wake_at = now
            for watchdog in due:
                watchdog.tick()
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
