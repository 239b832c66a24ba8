"""Sharded firing (``safe_time_beat_shards``): runtime entries hashed into K shards, each with its own
lease and epoch, so that several beat processes share the firing.

Shard 0 is the leader of one beat: the config entries (``beat_schedule``, the sweep) and its part of
the runtime entries, on the keys one leader always used. Each other shard has keys of its own (a
lease, an epoch, a state, a due set, an applied marker: :meth:`..backends.base.BeatBackend.for_shard`)
and is led like shard 0 by whichever beat holds its lease; the runtime definitions, their change log
and the fired-slot markers are shared, so a slot is published at most once whichever beat fires it,
also across a move.

Who holds what: every beat process keeps one :class:`ShardGate`, which publishes a heartbeat (how
many shards it holds) and reads the others'. With ``n`` live beats, a beat takes a free shard while it
holds fewer than ``ceil(K / n)``, gives one back when it holds more, and gives one back when it holds
more than ``K // n`` while another beat holds fewer (the one holding most gives). A given-back shard
is not taken again by the same beat for two renew intervals, so the beat that is short takes it.

Failover: a killed beat's leases expire within one lease; its heartbeat is counted as gone after
``BEAT_SHARD_HEARTBEAT_LEASES`` of a lease (less than one), so by then the others' fair share already
counts one beat fewer, and each shard's standby poll (every lease/3 at most) takes it: within
lease + lease/3, as one leader's failover.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Protocol

from .. import constants as C

__all__ = ["ShardGate", "fair_share", "shard_of"]

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


class HeldLease(Protocol):
    """What the gate reads of a shard's lease keeper (:class:`..leader.LeaderKeeper`)."""

    shard: int

    @property
    def is_leader(self) -> bool: ...


#: heartbeat(member, held, now, window) -> {member: shards held} of the live beats (this one included)
Heartbeat = Callable[[str, int, float, float], dict[str, int]]


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
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shards = shards
        self.lease = lease
        self.member = uuid.uuid4().hex
        self.keepers: list[HeldLease] = []
        self._heartbeat = heartbeat
        self._now = now
        self._monotonic = monotonic
        self._lock = threading.Lock()
        #: the live beats' shard counts as last read, and when (``monotonic``)
        self._beats: dict[str, int] = {}
        self._read_at = float("-inf")
        #: shard -> until when (``monotonic``) this beat leaves it to the others, having given it back
        self._cooldown: dict[int, float] = {}

    @property
    def renew_interval(self) -> float:
        return self.lease / 3.0

    @property
    def window(self) -> float:
        """How old a heartbeat may be and its beat still count as live."""
        return self.lease * C.BEAT_SHARD_HEARTBEAT_LEASES

    def held(self) -> int:
        return sum(1 for keeper in self.keepers if keeper.is_leader)

    def beats(self, *, fresh: bool = False) -> dict[str, int]:
        """The live beats and their shard counts (this one's as of now), read at most every renew/2
        (``fresh``: now)."""
        with self._lock:
            if fresh or self._monotonic() - self._read_at >= self.renew_interval / 2:
                self._beats = dict(self._heartbeat(self.member, self.held(), self._now(), self.window))
                self._read_at = self._monotonic()
            beats = dict(self._beats)
        beats[self.member] = self.held()
        return beats

    def may_acquire(self, keeper: HeldLease) -> bool:
        """Whether ``keeper``'s shard, found free, may be taken by this beat now."""
        until = self._cooldown.get(keeper.shard)
        if until is not None and self._monotonic() < until:
            return False
        _, most = fair_share(self.shards, len(self.beats()))
        return self.held() < most

    def should_release(self, keeper: HeldLease) -> bool:
        """Whether ``keeper`` (holding its shard) should give it back now, so that a beat that holds
        fewer takes it. Only this beat's highest held shard is given back, one per renewal."""
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
        with self._lock:
            self._read_at = float("-inf")  # the count others see changed: publish it at the next look
