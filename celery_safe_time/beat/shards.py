"""Sharded firing (``safe_time_beat_shards``): runtime entries hashed into K shards, each with its own
lease and epoch, so that several beat processes share the firing.

Shard 0 is one beat's leader: the config entries (``beat_schedule``, the sweep) and its part of the runtime
entries, on the keys one leader always used. Each other shard has keys of its own (lease, epoch, state, due
set, applied marker: :meth:`..backends.base.BeatBackend.for_shard`) and is led like shard 0; the runtime
definitions, their change log and the fired-slot markers are shared, so a slot is published at most once
whichever beat fires it, also across a move.

Who holds what: each beat process keeps one :class:`ShardGate`, which publishes a heartbeat (:class:`BeatPulse`)
and reads the others'. With ``n`` live beats, a beat takes a free shard while it holds fewer than ``ceil(K / n)``,
gives one back when it holds more, or when it holds more than ``K // n`` while another beat holds fewer (the one
holding most gives). A given-back shard is not taken again by the same beat for two renew intervals.

One K: the heartbeat also carries the beat's K, start time and planning fingerprint. The K of the live beat that
started first (:func:`incumbent`) is in force: a beat with another K takes no shard and gives back any it holds
(logged once, at ERROR), so a rolling change of K waits until no beat with the old one is alive. One leader
(K = 1) publishes the heartbeat too.

Failover: a killed beat's leases expire within one lease and its heartbeat counts as gone sooner
(``BEAT_SHARD_HEARTBEAT_LEASES``), so each shard's standby poll (every lease/3 at most) takes it within
lease + lease/3, as one leader's failover.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from typing import NamedTuple, Protocol

from .. import constants as C

__all__ = ["BeatPulse", "ShardGate", "fair_share", "incumbent", "shard_of"]

logger = logging.getLogger(__name__)


def shard_of(name: str, shards: int) -> int:
    """The shard of the runtime entry ``name``: CRC-32 of its UTF-8 bytes modulo ``shards`` (stable
    across processes and versions, unlike ``hash``)."""
    if shards <= 1:
        return 0
    return zlib.crc32(name.encode("utf-8", "surrogatepass")) % shards


def fair_share(shards: int, beats: int) -> tuple[int, int]:
    """(fewest, most) shards a beat should hold when ``beats`` share ``shards``."""
    beats = max(1, beats)
    return shards // beats, -(-shards // beats)


class BeatPulse(NamedTuple):
    """One beat's heartbeat: when it was last seen and how many shards it holds, with the settings its
    share depends on, so that the others see a beat that splits the names otherwise."""

    #: when this beat last said it is alive (the backend's clock, UNIX seconds)
    seen: float
    #: how many shards it holds
    held: int
    #: its ``safe_time_beat_shards``
    shards: int
    #: when it started (the backend's clock): the beats that started first decide K
    since: float
    #: its planning fingerprint (``ReplanningScheduler.fingerprint``)
    fingerprint: str

    def dump(self) -> str:
        return f"{self.seen!r} {self.held} {self.shards} {self.since!r} {self.fingerprint}"

    @classmethod
    def load(cls, raw: str) -> BeatPulse | None:
        """The pulse stored as ``raw`` (:meth:`dump`); None when it does not parse."""
        parts = raw.split(" ", 4)
        try:
            seen, held, shards, since = float(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])
        except (IndexError, ValueError):
            return None
        return cls(seen, held, shards, since, parts[4] if len(parts) > 4 else "")


def incumbent(pulses: dict[str, BeatPulse]) -> tuple[str, BeatPulse] | None:
    """The live beat that started first (ties: the lowest member): its ``safe_time_beat_shards`` is the
    one every beat fires with; a beat with another K takes no shard while it lives."""
    if not pulses:
        return None
    member = min(pulses, key=lambda m: (pulses[m].since, m))
    return member, pulses[member]


class HeldLease(Protocol):
    """What the gate reads of a shard's lease keeper (:class:`..leader.LeaderKeeper`)."""

    shard: int

    @property
    def is_leader(self) -> bool: ...


#: heartbeat(member, pulse, window) -> {member: pulse} of the live beats (this one included)
Heartbeat = Callable[[str, BeatPulse, float], dict[str, BeatPulse]]


class ShardGate:
    """One beat process's say in which shards it holds (see the module docstring).

    The keepers of its shards (one thread each) ask :meth:`may_acquire` before they try a free lease
    and :meth:`should_release` after each renewal. Thread-safe.
    """

    def __init__(
        self,
        shards: int,
        lease: float,
        heartbeat: Heartbeat,
        now: Callable[[], float],
        *,
        fingerprint: str = "",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shards = shards
        self.lease = lease
        self.fingerprint = fingerprint
        self.member = uuid.uuid4().hex
        self.keepers: list[HeldLease] = []
        self._heartbeat = heartbeat
        self._now = now
        self._monotonic = monotonic
        self._lock = threading.Lock()
        #: when this beat started (the backend's clock; set at its first heartbeat)
        self.since: float | None = None
        #: the live beats' pulses as last read, and when (``monotonic``)
        self._pulses: dict[str, BeatPulse] = {}
        self._read_at = float("-inf")
        #: shard -> until when (``monotonic``) this beat leaves it to the others, having given it back
        self._cooldown: dict[int, float] = {}
        #: the disagreement last logged (so that each one is logged once, not at every renewal)
        self._logged: tuple[object, ...] | None = None

    @property
    def renew_interval(self) -> float:
        return self.lease / 3.0

    @property
    def window(self) -> float:
        """How old a heartbeat may be and its beat still count as live."""
        return self.lease * C.BEAT_SHARD_HEARTBEAT_LEASES

    def held(self) -> int:
        return sum(1 for keeper in self.keepers if keeper.is_leader)

    def pulses(self, *, fresh: bool = False) -> dict[str, BeatPulse]:
        """The live beats' pulses (this one's as of now), read at most every renew/2 (``fresh``: now)."""
        with self._lock:
            if fresh or self._monotonic() - self._read_at >= self.renew_interval / 2:
                now = self._now()
                if self.since is None:
                    self.since = now
                mine = BeatPulse(now, self.held(), self.shards, self.since, self.fingerprint)
                self._pulses = dict(self._heartbeat(self.member, mine, self.window))
                self._read_at = self._monotonic()
                self._log_disagreement()
            pulses = dict(self._pulses)
        if self.member in pulses:
            pulses[self.member] = pulses[self.member]._replace(held=self.held())
        return pulses

    def beats(self, *, fresh: bool = False) -> dict[str, int]:
        """The live beats that fire with this beat's K, and their shard counts (this one's as of now)."""
        counts = {m: p.held for m, p in self.pulses(fresh=fresh).items() if p.shards == self.shards}
        counts[self.member] = self.held()
        return counts

    def agrees(self) -> bool:
        """Whether this beat may hold shards: the live beat that started first has its K (see
        :func:`incumbent`); False while one with another K lives."""
        first = incumbent(self.pulses())
        return first is None or first[1].shards == self.shards

    def may_acquire(self, keeper: HeldLease) -> bool:
        """Whether ``keeper``'s shard, found free, may be taken by this beat now."""
        until = self._cooldown.get(keeper.shard)
        if until is not None and self._monotonic() < until:
            return False
        if not self.agrees():
            return False
        _, most = fair_share(self.shards, len(self.beats()))
        return self.held() < most

    def should_release(self, keeper: HeldLease) -> bool:
        """Whether ``keeper`` (holding its shard) should give it back now, so that a beat that holds
        fewer takes it. Only this beat's highest held shard is given back, one per renewal; every
        shard is given back while a beat that started first has another K."""
        if not self.agrees():
            return True
        held = [k.shard for k in self.keepers if k.is_leader]
        if not held or keeper.shard != max(held):
            return False
        beats = self.beats()
        fewest, most = fair_share(self.shards, len(beats))
        mine = len(held)
        if mine > most:
            return True
        if mine <= fewest or not any(count < fewest for count in beats.values()):
            return False
        # several beats may hold more than the fewest: the one holding most gives (ties: the first member)
        return min(beats, key=lambda member: (-beats[member], member)) == self.member

    def released(self, keeper: HeldLease) -> None:
        """``keeper`` gave its shard back: leave it to the other beats for two renew intervals."""
        self._cooldown[keeper.shard] = self._monotonic() + 2 * self.renew_interval
        self.changed()

    def changed(self) -> None:
        """The count others see changed (a shard taken or given back): publish it at the next look."""
        with self._lock:
            self._read_at = float("-inf")

    def _log_disagreement(self) -> None:
        """Log once (each time it changes) that a live beat splits the names otherwise (another K: an
        error, this beat or that one takes no shard) or plans them otherwise (another fingerprint: a
        warning, a shard moving between them is planned afresh)."""
        others = {m: p for m, p in self._pulses.items() if m != self.member}
        other_k = sorted({p.shards for p in others.values() if p.shards != self.shards})
        other_fp = sorted({p.fingerprint for p in others.values() if p.fingerprint != self.fingerprint})
        first = incumbent(self._pulses)
        waiting = first is not None and first[1].shards != self.shards
        state = (tuple(other_k), tuple(other_fp), waiting)
        if state == self._logged:
            return
        self._logged = state
        if other_k and waiting and first is not None:
            logger.error(
                "beat: safe_time_beat_shards is %d here but %d on a live beat that started first: this beat "
                "takes no shard until no beat with safe_time_beat_shards = %d is alive (`celery safe-time "
                "check` lists the beats)",
                self.shards,
                first[1].shards,
                first[1].shards,
            )
        elif other_k:
            logger.error(
                "beat: safe_time_beat_shards is %d here but %s on other live beat(s), which take no shard "
                "while this one lives: set the same value on every beat",
                self.shards,
                ", ".join(map(str, other_k)),
            )
        if other_fp:
            logger.warning(
                "beat: a live beat plans entries with another fingerprint (%s; this one: %s): a shard moving "
                "between them re-plans its entries",
                "; ".join(other_fp),
                self.fingerprint,
            )
