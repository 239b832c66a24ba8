"""Keeps (or keeps trying to take) the beat lease in a background thread.

The thread renews every lease/3 whatever the scheduler's tick is doing, so a slow tick never
costs the lease; a standby tries every lease/3 minus jitter, which bounds failover after a
``kill -9`` by lease + lease/3. Any doubt (renew refused, a backend error) means standby at once:
the dispatch script would refuse to publish anyway, and failing closed is the point.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from .. import constants as C
from .. import signals
from ..clock import ServerClock
from ..config import SafeTimeConfig
from ..exceptions import RedisUnavailable
from .backends.base import BeatLease
from .shards import ShardGate

logger = logging.getLogger(__name__)


class LeaseTerm(NamedTuple):
    """One lease this beat took: ``generation`` counts this process's acquisitions, so it never repeats.

    The epoch alone does not tell leases apart: epochs restart at 1 after a backend reset (a flushed
    Redis, a dropped table), and a beat can lose its lease and take a new one with the same epoch
    number between two ticks. What a scheduler reads or reconciles "once per lease" is keyed on the
    whole term.
    """

    generation: int
    epoch: int


class LeaderKeeper:
    """Owns a :class:`Lease` and the thread that holds it. ``term`` (and ``epoch``) is None while standby."""

    def __init__(
        self,
        lease: BeatLease,
        clock: ServerClock,
        config: SafeTimeConfig,
        sender: Any,
        errors: tuple[type[Exception], ...] = (redis.RedisError, RedisUnavailable),
        what: str = "Redis",
        *,
        shard: int = 0,
        gate: ShardGate | None = None,
    ) -> None:
        self.lease = lease
        #: the shard this lease leads, and the gate that says whether to take or give it back
        #: (``safe_time_beat_shards`` above 1; None: one leader, the lease taken whenever free)
        self.shard = shard
        self.gate: ShardGate | None = None
        #: the lease's name in log lines
        self.lease_name = "the leader lease"
        if gate is not None:
            self.join(gate)
        #: The clock an acquire is timed on (tests replace it to make an answer late).
        self.lease_clock: Callable[[], float] = time.monotonic
        #: what the backend raises when it fails (Redis's by default)
        self.errors = errors
        #: the backend's name in log lines
        self.what = what
        self.clock = clock
        self.config = config
        self.sender = sender
        self._term: LeaseTerm | None = None
        self._generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._backend_down = False
        self.last_error: str | None = None

    @property
    def term(self) -> LeaseTerm | None:
        """The lease held now (one attribute read: generation and epoch always belong together)."""
        return self._term

    @property
    def epoch(self) -> int | None:
        term = self._term
        return None if term is None else term.epoch

    @property
    def is_leader(self) -> bool:
        return self._term is not None

    def join(self, gate: ShardGate) -> None:
        """Take part in sharded firing: ``gate`` decides when this shard's lease is taken or given back."""
        self.gate = gate
        if gate.shards > 1:
            self.lease_name = f"the lease of shard {self.shard}"
        gate.keepers.append(self)

    # --- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Try once now (so the banner can say leader/standby), then keep going in a thread."""
        self._attempt()
        self._thread = threading.Thread(target=self._run, name="safe-time-beat-lease", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        """Stop the thread and, if leading, delete the lease so a standby takes over at its next poll."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=C.BEAT_RENEW_TIMEOUT)
        with self._lock:
            term, self._term = self._term, None
            epoch = None if term is None else term.epoch
            if release and epoch is not None:
                try:
                    self.lease.release()
                    logger.info("beat: released %s (epoch %s)", self.lease_name, epoch)
                except self.errors as exc:
                    logger.warning("beat: could not release the lease (it expires by itself): %s", exc)

    def step_down(self, reason: str) -> None:
        """Called by the scheduler when the dispatch script refused it: the lease is gone."""
        with self._lock:
            self._lost(reason)

    # --- thread -------------------------------------------------------------------
    def _run(self) -> None:
        renew = self.config.beat_renew_interval
        backoff = renew
        while not self._stop.is_set():
            ok = self._attempt()
            if ok:
                backoff = renew
                # standbys poll with jitter (never later than lease/3, which bounds failover)
                wait = renew if self.is_leader else renew * random.uniform(0.75, 1.0)
            else:
                wait = backoff
                backoff = min(backoff * 2, max(self.config.beat_lease, renew))
            self._stop.wait(wait)

    def _attempt(self) -> bool:
        """One renew (leader) or acquire (standby) round; False when the backend failed."""
        with self._lock:
            if self._stop.is_set():
                return True
            try:
                if self._term is not None:
                    if not self.lease.renew():
                        self._lost("lease expired or taken over")
                    elif self.gate is not None and self.gate.should_release(self):
                        self._give_back(self.gate)
                elif self.gate is not None and not self.gate.may_acquire(self):
                    pass  # this beat holds its share of the shards: the others take this one
                else:
                    sent_at = self.lease_clock()
                    self.lease.sent_at = None
                    epoch = self.lease.acquire(self.clock.time())
                    sent_at = max(sent_at, self.lease.sent_at or sent_at)  # after the backend's preparation
                    if epoch is not None and self._answered_late(epoch, self.lease_clock() - sent_at):
                        epoch = None
                    if epoch is not None:
                        self._generation += 1
                        self._term = LeaseTerm(self._generation, epoch)
                        if self.gate is not None:
                            self.gate.changed()
                        logger.info(
                            "beat: acquired %s (epoch %s, lease %gs)", self.lease_name, epoch, self.config.beat_lease
                        )
                        signals.beat_lease_acquired.send(sender=self.sender, epoch=epoch, lease=self.config.beat_lease)
            except self.errors as exc:
                self.last_error = str(exc)
                if self._term is not None:
                    self._lost(f"{self.what} error: {exc}")
                if not self._backend_down:
                    logger.error(
                        "beat: %s unreachable, nothing fires until it is back (fail closed): %s", self.what, exc
                    )
                self._backend_down = True
                return False
            if self._backend_down:
                logger.warning("beat: %s reachable again", self.what)
                self._backend_down = False
            return True

    def _give_back(self, gate: ShardGate) -> None:
        """Release this shard's lease for a beat that holds fewer shards (rebalancing)."""
        term, self._term = self._term, None
        epoch = None if term is None else term.epoch
        gate.released(self)
        self.lease.release()
        logger.info("beat: gave back %s (epoch %s) to a beat that holds fewer shards", self.lease_name, epoch)
        signals.beat_lease_lost.send(sender=self.sender, epoch=epoch, reason="rebalanced to another beat")

    def _answered_late(self, epoch: int, waited: float) -> bool:
        """Whether the lease just taken (``epoch``) was answered too late to hold: it runs from when the
        acquire was sent, and an answer past ``LEASE_LATE_REPLY_SHARE`` of it may come after the lease
        ended (another beat took over) or leave no time for the first renewal. Such a lease is released."""
        lease = self.config.beat_lease
        if waited <= lease * C.LEASE_LATE_REPLY_SHARE:
            return False
        logger.warning(
            "beat: the leader lease (epoch %s) was answered %.2fs after it was asked for, more than %.0f%% of "
            "its %gs: not taking it (released), trying again later",
            epoch,
            waited,
            C.LEASE_LATE_REPLY_SHARE * 100,
            lease,
        )
        try:
            self.lease.release()
        except self.errors as exc:
            logger.warning("beat: could not release the late lease (it expires by itself): %s", exc)
        self.lease.epoch = None
        return True

    def _lost(self, reason: str) -> None:
        term, self._term = self._term, None
        self.lease.epoch = None
        if term is None:
            return
        epoch = term.epoch
        logger.warning("beat: lost %s (epoch %s): %s; standing by", self.lease_name, epoch, reason)
        signals.beat_lease_lost.send(sender=self.sender, epoch=epoch, reason=reason)
