"""The shard contract of the beat backends (``safe_time_beat_shards``), on each backend that has shards
(Redis, PostgreSQL, memory): a lease and an epoch per shard, each shard's state and due set its own,
the fired-slot markers and the definitions shared, the API side reading each entry from its shard,
and the heartbeats the beats share the shards by; then three beats' gates and keepers on the real
backend, one of them stopped dead: its shards move within lease + lease/3."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_safe_time.beat.backends import BeatBackend, SlotWrite, beat_backend
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.shards import BeatPulse, shard_of
from celery_safe_time.config import get_config
from tests.helpers.beat import ShardBeat, coordination_settings

pytestmark = pytest.mark.integration

SHARDS = 3
LEASE = 3.0


def _name_in(shard: int, prefix: str = "tenant") -> str:
    """The first ``<prefix>-<i>`` whose shard is ``shard``."""
    return next(f"{prefix}-{i}" for i in range(1000) if shard_of(f"{prefix}-{i}", SHARDS) == shard)


@pytest.fixture(params=["redis", "postgres", "memory"])
def backends(request: pytest.FixtureRequest, make_app: Any) -> Callable[[], BeatBackend]:
    """Root backends (shard 0) of one app with three shards, as several beats would hold them."""
    conf: dict[str, Any] = {"safe_time_beat_lease": LEASE, "safe_time_beat_shards": SHARDS}
    if request.param == "memory":
        data = MemoryBeatData()
        config = get_config(make_app(**conf))
        return lambda: MemoryBeatBackend(config, data)
    if request.param == "postgres":
        conf.update(coordination_settings(request.getfixturevalue("postgres_url")))
    config = get_config(make_app(**conf))

    def make() -> BeatBackend:
        backend = beat_backend(config)
        backend.startup_checks("test")
        return backend

    return make


def test_each_shard_has_its_own_lease_and_epoch(backends: Callable[[], BeatBackend]) -> None:
    root = backends()
    one, two = root.for_shard(1), backends().for_shard(2)
    assert (root.shard, one.shard, two.shard) == (0, 1, 2)
    a0, a1, b2 = root.make_lease(), one.make_lease(), two.make_lease()
    assert a0.acquire(0.0) == 1
    assert a1.acquire(0.0) == 1  # shard 1's lease is free although shard 0's is held
    assert b2.acquire(0.0) == 1
    assert backends().for_shard(1).make_lease().acquire(0.0) is None  # held: another beat waits
    assert a1.release()
    c1 = backends().for_shard(1).make_lease()
    assert c1.acquire(0.0) == 2  # shard 1's epoch moved, the others' did not
    assert root.lease_view().epoch == 1
    assert one.lease_view().epoch == 2
    assert one.lease_view().info["token"] == c1.token[:8]
    assert root.holds_lease(a0.token)
    assert not root.holds_lease(c1.token)  # a shard's token holds only its own lease
    assert one.holds_lease(c1.token)
    # a shard's lease guards its own writes only
    assert c1.write_slots(2, [SlotWrite(_name_in(1), "{}", 10.0, 5.0)]) == [1]
    assert a0.write_slots(2, [SlotWrite(_name_in(0), "{}", 10.0, 5.0)]) == [-1]  # shard 0's epoch is 1


def test_each_shard_has_its_own_state_and_due_set_and_the_fired_markers_are_shared(
    backends: Callable[[], BeatBackend],
) -> None:
    root = backends()
    shards = [root.for_shard(s) for s in range(SHARDS)]
    leases = [backend.make_lease() for backend in shards]
    epochs = [lease.acquire(0.0) for lease in leases]
    assert epochs == [1, 1, 1]
    names = [_name_in(s) for s in range(SHARDS)]
    for shard, (lease, name) in enumerate(zip(leases, names, strict=True)):
        assert lease.write_slots(1, [SlotWrite(name, f'{{"s": {shard}}}', 100.0 + shard, 50.0)]) == [1]
    for shard, backend in enumerate(shards):
        read = backend.read_due(1000.0, 10)
        assert read.due == [(names[shard], 100.0 + shard)]  # only its own entries
        assert (read.due_count, read.state_count) == (1, 1)
        assert backend.head() == [(names[shard], 100.0 + shard)]
        stored, _, _ = backend.read_all()
        assert set(stored) == {names[shard]}
    # a slot fired by one shard's leader is fired for every shard's (a move never fires it again)
    assert leases[2].dispatch_slot(1, names[0], 50.0) == 0
    assert root.slot_fired(names[1], 50.0)
    # the API side reads each entry from its shard, whichever backend object asks
    states, due, _ = backends().entry_rows(names)
    assert [s.decode() if isinstance(s, bytes) else s for s in states] == [f'{{"s": {s}}}' for s in range(SHARDS)]
    assert due == [100.0, 101.0, 102.0]
    counts = backends().entry_counts(101.5)
    assert (counts.scheduled, counts.due_soon) == (3, 2)
    # a seeded state lands in the entry's shard (its leader plans it from there)
    seeded = _name_in(2, "seeded")
    root.entry_seed_state(seeded, '{"seeded": true}')
    assert seeded in shards[2].read_all()[0]
    assert seeded not in shards[0].read_all()[0]
    if root.name != "memory":  # each shard's applied marker is its own (the memory backend keeps none)
        shards[1].mark_applied(leases[1].token, "7 one")
        assert shards[1].snapshot_meta().marker == "7 one"
        assert shards[0].snapshot_meta().marker != "7 one"
    # forgetting an entry in one shard leaves the others alone
    assert leases[0].forget(1, [names[0]], keep_state=False)
    assert shards[0].due_count() == 0
    assert shards[1].due_count() == 1


def test_the_heartbeats_count_the_live_beats(backends: Callable[[], BeatBackend]) -> None:
    a, b = backends(), backends()
    now = a.clock.time()

    def beat(member: BeatBackend, name: str, held: int, at: float, shards: int = 4) -> dict[str, tuple[int, int]]:
        pulse = BeatPulse(at, held, shards, now, "fp")
        return {m: (p.held, p.shards) for m, p in member.beats_heartbeat(name, pulse, 2.0).items()}

    assert beat(a, "a", 2, now) == {"a": (2, 4)}
    assert beat(b, "b", 1, now + 0.5, shards=3) == {"a": (2, 4), "b": (1, 3)}
    assert beat(a, "a", 3, now + 1.0) == {"a": (3, 4), "b": (1, 3)}
    # a heartbeat older than the window is gone (a killed beat): dropped by whoever looks
    assert beat(a, "a", 3, now + 3.0) == {"a": (3, 4)}
    assert beat(b, "b", 0, now + 3.0, shards=3) == {"a": (3, 4), "b": (0, 3)}
    assert {m: p.since for m, p in a.beats_seen().items()} == {"a": now, "b": now}  # what status reads
    b.beats_gone("b")  # a closed beat drops its own
    assert beat(a, "a", 3, now + 3.1) == {"a": (3, 4)}


def test_three_beats_share_the_shards_and_a_dead_beats_move_within_lease_and_a_third(
    make_app: Any, coordination: dict[str, Any]
) -> None:
    config = get_config(make_app(safe_time_beat_lease=LEASE, safe_time_beat_shards=SHARDS * 2, **coordination))
    beats = []
    for _ in range(3):
        root = beat_backend(config)
        root.startup_checks("test")
        beats.append(ShardBeat(root))
    renew = LEASE / 3
    deadline = time.monotonic() + 12 * renew
    while time.monotonic() < deadline:  # each beat's keepers try once per renew interval, as their threads
        for beat in beats:
            beat.round()
        if sorted(len(b.held()) for b in beats) == [2, 2, 2]:
            break
        time.sleep(renew)
    assert sorted(len(b.held()) for b in beats) == [2, 2, 2]
    dead = beats.pop()  # stopped dead: no release, no more heartbeats
    orphans = dead.held()
    killed_at = time.monotonic()
    moved_at = None
    while time.monotonic() < killed_at + 3 * LEASE:
        for beat in beats:
            beat.round()
        if orphans <= set().union(*(b.held() for b in beats)):
            moved_at = time.monotonic()
            break
        time.sleep(renew)
    assert moved_at is not None, "the dead beat's shards did not move"
    # polled every renew interval (lease/3), as a standby's keeper: within lease + lease/3 (plus a round)
    assert moved_at - killed_at <= LEASE + LEASE / 3 + 0.5, moved_at - killed_at
    assert sorted(len(b.held()) for b in beats) == [3, 3]
    for beat in beats:
        for keeper in beat.keepers:
            keeper.lease.release()
        beat.root.beats_gone(beat.gate.member)
