"""What both safe schedulers share: the lease and its keeper thread, startup checks, the banner,
backend errors during a tick, and a clean exit on SIGTERM under ``worker -B``.

``LeasedScheduler`` is mixed in before a Celery ``Scheduler`` class: :class:`.SafeScheduler` here
and ``contrib.django``'s ``SafeDatabaseScheduler`` over django-celery-beat.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import redis
from celery import Celery, platforms
from celery import signals as celery_signals

from .. import constants as C
from ..clock import RedisClock
from ..config import SafeTimeConfig, get_config
from ..exceptions import ImproperlyConfigured
from .backends import BeatBackend, beat_backend
from .backends.redis import RedisBeatBackend
from .leader import LeaderKeeper
from .shards import ShardGate

__all__ = [
    "LeasedScheduler",
    "beat_info",
    "check_lease",
    "startup_checks",
    "stop_signals_held",
    "tick_granularity",
]

logger = logging.getLogger(__name__)


@contextmanager
def collector_paused(pause: bool = True) -> Iterator[None]:
    """The cyclic garbage collector off for the block when ``pause`` (and it was on).

    For the leader's bulk work, whose many objects are freed by their reference counts or all live
    on: a burst's chunk (thousands of short-lived entries and messages, over which the collector's
    passes cost a tenth of the tick's CPU), a chunk of a plan of every entry, a load of every entry
    (a million objects that stay, which the collector would otherwise walk again and again).
    """
    collecting = pause and gc.isenabled()
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def tick_granularity(max_interval: float) -> float:
    return min(float(max_interval), C.BEAT_TICK_CAP)


def check_lease(config: SafeTimeConfig, granularity: float) -> None:
    minimum = C.BEAT_MIN_LEASE_TICKS * granularity
    if config.beat_lease < minimum:
        raise ImproperlyConfigured(
            "safe_time_beat_lease",
            f"{config.beat_lease:g} s is shorter than {C.BEAT_MIN_LEASE_TICKS} x the beat tick "
            f"({granularity:g} s); use at least {minimum:g} s",
        )


def startup_checks(config: SafeTimeConfig, client: redis.Redis, clock: RedisClock, who: str) -> None:
    """Fail loudly when Redis is unreachable; warn about persistence and eviction (the Redis backend's)."""
    backend = RedisBeatBackend(config, client)
    backend.clock = clock
    backend.startup_checks(who)


def beat_info(config: SafeTimeConfig, keeper: LeaderKeeper, backend: BeatBackend, started: bool) -> str:
    """The banner line: this beat's role once running, else who holds the lease right now."""
    if started:
        state = f"leader (epoch {keeper.epoch})" if keeper.is_leader else "standby"
    else:
        try:
            holder = backend.lease_view().info
            state = (
                f"lease held by {holder.get('host')} pid {holder.get('pid')} (epoch {holder.get('epoch')}): standby"
                if holder
                else "lease free: this beat will take it"
            )
        except backend.errors as exc:
            state = f"{backend.label} unreachable ({exc})"
    return (
        f"    . safe-time -> {state}; lease {config.beat_lease:g}s, renewed every {config.beat_renew_interval:g}s; "
        f"{backend.where()}"
    )


class LeasedScheduler:
    """What both safe schedulers share: the lease, its keeper thread, the banner and shutdown.

    Mixed in before a Celery ``Scheduler`` class; ``init_lease`` runs before that class's
    ``__init__`` (which calls ``setup_schedule``), ``start_lease`` at the end of ``setup_schedule``.
    """

    app: Celery
    max_interval: float

    def init_lease(self, app: Celery, backend: BeatBackend | None = None, gate: ShardGate | None = None) -> None:
        """``backend``: a shard's (``safe_time_beat_shards``; default: the app's) and ``gate``: the beat's
        say in which shards it holds (None: one leader)."""
        self.config = get_config(app)
        self.backend = beat_backend(self.config) if backend is None else backend
        #: what a tick may raise when the backend fails; the scheduler then stands by (fail closed)
        self.backend_errors = self.backend.errors
        #: the Redis client on the Redis backend (None on the others)
        self.client = getattr(self.backend, "client", None)
        self.clock = self.backend.clock
        self.lease = self.backend.make_lease()
        self.keeper = LeaderKeeper(
            self.lease,
            self.clock,
            self.config,
            sender=self,
            errors=self.backend.errors,
            what=self.backend.label,
            shard=self.backend.shard,
            gate=gate,
        )
        self._closed = False
        self._started = False

    @property
    def granularity(self) -> float:
        return tick_granularity(self.max_interval)

    @property
    def standby_wait(self) -> float:
        """A standby's sleep: short, so it ticks as leader soon after its lease thread takes the lease
        (beat's loop sleeps what the tick returns and nothing wakes it sooner)."""
        return min(self.granularity, C.BEAT_STANDBY_WAKE)

    #: whether this scheduler splits its entries into ``safe_time_beat_shards`` shards
    shardable = False

    def check_startup(self, granularity: float) -> None:
        check_lease(self.config, granularity)
        if self.config.beat_shards > 1:
            if not self.shardable:
                raise ImproperlyConfigured(
                    "safe_time_beat_shards",
                    f"{self.config.beat_shards} shards: {type(self).__name__} fires from one leader; sharded "
                    "firing is SafeScheduler's (runtime entries); set it to 1",
                )
            self.backend.for_shard(1)  # refuses on a backend without shards
        self.backend.startup_checks("beat")
        # Imported here, once per start: the delays package (its store and task classes) is not
        # loaded by importing the scheduler.
        from ..install_check import not_installed_message, sweep_installed

        if not sweep_installed(self.app):
            logger.error("beat: %s", not_installed_message(self.app))

    def start_lease(self) -> None:
        self.keeper.start()
        self._started = True
        logger.info("beat: %s", self.info.strip(" ."))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.keeper.stop(release=True)
        super().close()  # type: ignore[misc]

    @property
    def info(self) -> str:
        return beat_info(self.config, self.keeper, self.backend, started=self._started)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        with stop_signals_held():  # beat stops between ticks, never inside one (see stop_signals_held)
            return self._tick()

    def _tick(self) -> float:
        raise NotImplementedError

    def backend_failed(self, exc: Exception) -> float:
        """A tick hit a backend (Redis, PostgreSQL) error: stand by until the keeper takes the lease again.

        The log and the step-down reason name the backend (``self.backend.label``). Returns the wait
        before the next tick.
        """
        what = self.backend.label
        logger.error("beat: %s error during tick, standing by: %s", what, exc)
        self.keeper.step_down(f"{what} error during tick: {exc}")
        return self.granularity


#: The signals beat stops on (``celery beat`` installs a handler for both that raises SystemExit).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Held:
    """What the stop-signal handlers read and write (main thread only: Python runs signal handlers
    there, between two bytecodes of whatever the main thread is doing)."""

    #: True inside a ``stop_signals_held`` block that still holds signals
    holding = False
    #: the first signal held in this block: (signum, frame, the handler it was meant for)
    pending: tuple[int, FrameType | None, Any] | None = None


def _holding(handler: Any) -> Any:
    """``handler`` (beat's own, or any callable set with ``signal.signal``) behind the hold: called at
    once outside a ``stop_signals_held`` block, held inside it."""

    def hold(signum: int, frame: FrameType | None) -> None:
        if not _Held.holding:
            _act_on(handler, signum, frame)
            return
        if _Held.pending is not None:  # the second: acted on now, the held one with it
            _Held.holding = False
            _Held.pending = None
            _act_on(handler, signum, frame)
            return
        _Held.pending = (signum, frame, handler)

    hold.__wrapped__ = handler  # type: ignore[attr-defined]
    hold._safe_time_hold = True  # type: ignore[attr-defined]
    return hold


def _is_holding(handler: Any) -> bool:
    return getattr(handler, "_safe_time_hold", False) is True


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block ends, then act on the first one that came.

    Beat's stop handler raises SystemExit wherever the main thread is, and each tick runs in this
    block. Between marking a slot fired and publishing it, that SystemExit would lose the slot on a
    plain restart (the guard says fired, so no beat sends it again). Inside a PostgreSQL call it would
    leave the connection mid-query, and the cleanup's own error would replace the SystemExit: the
    tick would log a database error, stand by, and beat never exit. A second stop signal inside the block acts at
    once, so a stuck call can still be interrupted. Outside the main thread (signals are never run
    there) this holds nothing.

    A Python handler (beat's) is wrapped once, by a handler that calls it at once outside the block
    and holds the signal inside it; each block then costs two reads of the handlers and a flag
    (wrapping and unwrapping them in every tick would be four ``signal.signal`` calls, the largest
    Python cost of an idle tick after its backend round trip). A handler set since (``signal.signal``
    by beat or a test) is wrapped at the next block. The default action (``SIG_DFL``) is wrapped
    for the block only: kept outside it, a SIGTERM kills the process even while the main thread is
    stuck in a C call, which a Python handler waiting for its turn would not.
    """
    if _Held.holding or threading.current_thread() is not threading.main_thread():
        yield  # off the main thread, or inside a block already (the outer one acts on what comes)
        return
    defaults: list[signal.Signals] = []
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        # None: a handler set outside Python, which signal.signal could not put back
        if handler is None or handler == signal.SIG_IGN or _is_holding(handler):
            continue
        if handler == signal.SIG_DFL:
            defaults.append(sig)
        signal.signal(sig, _holding(handler))
    _Held.pending = None
    _Held.holding = True
    try:
        yield
    finally:
        _Held.holding = False
        pending, _Held.pending = _Held.pending, None
        for sig in defaults:
            signal.signal(sig, signal.SIG_DFL)
        if pending is not None:
            signum, frame, handler = pending
            logger.info("beat: acting on signal %s held while publishing", signal.Signals(signum).name)
            _act_on(handler, signum, frame)


def _act_on(handler: Any, signum: int, frame: FrameType | None) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:  # put back first (else the hold gets it again): it terminates now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _release_on_sigterm(sender: Any = None, **kwargs: Any) -> None:
    """In ``worker -B`` the worker stops its beat process with SIGTERM, which by default kills it
    on the spot, lease held, and the standbys wait a whole lease. Exit cleanly instead: beat's
    loop then closes the scheduler, which deletes the lease."""
    scheduler = getattr(sender, "scheduler", None)
    if getattr(scheduler, "keeper", None) is None:
        return

    def _exit(*args: Any) -> None:
        raise SystemExit()

    platforms.signals["TERM"] = _exit


celery_signals.beat_embedded_init.connect(_release_on_sigterm, weak=False)
