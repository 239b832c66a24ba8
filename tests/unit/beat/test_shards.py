"""Sharded firing (``safe_time_beat_shards``) on the in-memory backend, time injected: which shard an
entry belongs to, how beats share the shard leases (take, give back, take over a killed beat's), and
that each slot is published at most once across a move. No Redis, no sleeping."""

from __future__ import annotations

import collections
import itertools
import zlib
from pathlib import Path
from typing import Any

import pytest

from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.definitions import definition_json
from celery_safe_time.beat.leader import LeaderKeeper
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.beat.shards import fair_share, shard_of
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ImproperlyConfigured
from tests.helpers.beat import ShardBeat
from tests.unit.beat.conftest import FakeTime, OnDispatched, memory_app

LEASE = 30.0
RENEW = LEASE / 3
EVERY_SECOND = {"type": "interval", "every": 1.0}
_BEATS = itertools.count()


def test_an_entry_belongs_to_the_shard_of_its_name_crc32() -> None:
    assert shard_of("tenant-7", 1) == 0
    assert shard_of("tenant-7", 5) == zlib.crc32(b"tenant-7") % 5
    assert shard_of("tenant-7", 5) == shard_of("tenant-7", 5)  # stable (not Python's salted hash)
    counts = collections.Counter(shard_of(f"tenant-{i}", 4) for i in range(10_000))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 2_300  # about a quarter each


@pytest.mark.parametrize(
    ("shards", "beats", "share"), [(1, 3, (0, 1)), (3, 3, (1, 1)), (4, 3, (1, 2)), (8, 3, (2, 3)), (6, 0, (6, 6))]
)
def test_fair_share(shards: int, beats: int, share: tuple[int, int]) -> None:
    assert fair_share(shards, beats) == share


def test_the_setting_is_validated_and_refused_where_it_cannot_work() -> None:
    with pytest.raises(ImproperlyConfigured, match="safe_time_beat_shards"):
        get_config(memory_app("bad-shards", safe_time_beat_shards=0))
    with pytest.raises(ImproperlyConfigured, match="safe_time_beat_shards"):
        get_config(memory_app("bad-shards-2", safe_time_beat_shards="3"))
    config = get_config(memory_app("pg-shards", safe_time_beat_shards=3))
    backend = MemoryBeatBackend(config)
    backend.for_shard(1)  # the memory backend has shards
    from celery_safe_time.beat.backends.base import BeatBackend

    with pytest.raises(ImproperlyConfigured, match=r"safe_time_beat_shards.*need Redis or PostgreSQL coordination"):
        BeatBackend.for_shard(backend, 1)  # what a backend without shards answers


def _beat(data: MemoryBeatData, clock: FakeTime, shards: int) -> ShardBeat:
    """One beat process's shard leases on ``data``, its gate and acquires timed on ``clock``."""
    config = get_config(memory_app(f"shard-beat-{next(_BEATS)}", safe_time_beat_shards=shards))
    return ShardBeat(MemoryBeatBackend(config, data), monotonic=clock)


def _run(beats: list[ShardBeat], clock: FakeTime, seconds: float) -> None:
    """Each beat's keepers attempt once per renew interval (as their threads do), for ``seconds``."""
    end = clock.now + seconds
    while clock.now < end:
        for beat in beats:
            beat.round()
        clock.now += RENEW


def test_three_beats_share_six_shards_and_a_killed_beats_move_within_lease_and_a_third(
    data: MemoryBeatData, clock: FakeTime
) -> None:
    beats = [_beat(data, clock, 6) for _ in range(3)]
    beats[0].round()  # the first beat alone: it takes every shard
    assert beats[0].held() == set(range(6))
    _run(beats, clock, 8 * RENEW)  # the others come: it gives back one per renewal until each holds 2
    assert sorted(len(b.held()) for b in beats) == [2, 2, 2]
    assert set().union(*(b.held() for b in beats)) == set(range(6))
    # kill -9 beat 2: no release, no more heartbeats
    dead = beats.pop(2)
    orphans = dead.held()
    killed_at = clock.now
    taken_at = None
    while clock.now <= killed_at + LEASE + LEASE / 3:
        for beat in beats:
            beat.round()
        if set().union(*(b.held() for b in beats)) == set(range(6)):
            taken_at = clock.now
            break
        clock.now += RENEW
    assert taken_at is not None, "the killed beat's shards did not move within lease + lease/3"
    assert taken_at - killed_at <= LEASE + LEASE / 3
    assert sorted(len(b.held()) for b in beats) == [3, 3]
    assert orphans <= set().union(*(b.held() for b in beats))
    # a new beat joins: the others give back until each holds 2 again
    beats.append(_beat(data, clock, 6))
    _run(beats, clock, 10 * RENEW)
    assert sorted(len(b.held()) for b in beats) == [2, 2, 2]


def test_uneven_shares_reach_one_apart(data: MemoryBeatData, clock: FakeTime) -> None:
    beats = [_beat(data, clock, 4) for _ in range(3)]
    for beat in beats[:2]:  # two beats split the four shards before the third comes
        beat.round()
    _run(beats[:2], clock, 6 * RENEW)
    assert sorted(len(b.held()) for b in beats[:2]) == [2, 2]
    _run(beats, clock, 10 * RENEW)
    assert sorted(len(b.held()) for b in beats) == [1, 1, 2]


def test_a_beat_with_another_k_takes_no_shard_while_a_beat_with_the_first_k_lives(
    data: MemoryBeatData, clock: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    """Two Ks would split the names differently: the beats that started first keep firing with theirs
    (not counting the other), and a beat with another K takes nothing, logs an error naming the
    setting, and takes its shards once no beat with the first K is alive (a rolling change of K)."""
    old = [_beat(data, clock, 6) for _ in range(2)]
    _run(old, clock, 8 * RENEW)
    assert sorted(len(b.held()) for b in old) == [3, 3]
    clock.now += 1.0
    with caplog.at_level("ERROR", logger="celery_safe_time.beat.shards"):
        new = _beat(data, clock, 4)
        _run([*old, new], clock, 8 * RENEW)
    assert new.held() == set()
    assert sorted(len(b.held()) for b in old) == [3, 3]  # the other K is not counted in the fair share
    assert "safe_time_beat_shards is 4 here but 6 on a live beat that started first" in caplog.text
    refused = [r for r in caplog.records if "takes no shard until" in r.getMessage()]
    assert len(refused) == 1  # logged once, not at every renewal
    pulses = new.gate.pulses(fresh=True)
    assert sorted(p.shards for p in pulses.values()) == [4, 6, 6]
    # the old beats stop one by one (as a rolling restart does): the new K waits for the last of them
    for keeper in old[0].keepers:  # closed: its leases released and its heartbeat dropped
        keeper.stop(release=True)
    MemoryBeatBackend(get_config(memory_app("gone", safe_time_beat_shards=6)), data).beats_gone(old[0].gate.member)
    _run([old[1], new], clock, 4 * RENEW)
    assert new.held() == set()
    assert len(old[1].held()) == 6
    # the last old beat is killed: its heartbeat goes stale, its leases expire, the new K takes over
    _run([new], clock, LEASE + 2 * RENEW)
    assert new.held() == {0, 1, 2, 3}


def test_the_first_beat_s_k_wins_and_a_beat_that_started_later_gives_its_shards_back(
    data: MemoryBeatData, clock: FakeTime
) -> None:
    """A beat that already holds shards gives every one back when it sees that a beat with another K
    started before it (its heartbeat was stale for a moment, say)."""
    first = _beat(data, clock, 3)
    first.round()
    first.gate.pulses(fresh=True)
    heartbeat = data.beats.pop(first.gate.member)  # stale for a while: the later beat sees no one
    for keeper in first.keepers:
        keeper.stop(release=True)
    later = _beat(data, clock, 2)
    clock.now += 1.0
    later.round()
    assert later.held() == {0, 1}
    data.beats[first.gate.member] = heartbeat._replace(seen=clock.now)  # the first beat is back
    later.gate.pulses(fresh=True)
    later.round()
    assert later.held() == set()


def test_a_beat_left_at_one_shard_beside_sharded_beats_takes_nothing(data: MemoryBeatData, clock: FakeTime) -> None:
    """One leader (K = 1) writes a heartbeat too: started after sharded beats, it does not lead shard 0's
    lease (as one leader of every entry, beside them); started first, the sharded ones wait."""
    sharded = _beat(data, clock, 3)
    sharded.round()
    clock.now += 1.0
    single = _beat(data, clock, 1)
    sharded.keepers[0].stop(release=True)  # shard 0 is free: the single beat could take it
    _run([sharded, single], clock, 4 * RENEW)
    assert single.held() == set()
    # the sharded beat stops for good: the single beat leads
    for keeper in sharded.keepers:
        keeper.stop(release=True)
    MemoryBeatBackend(get_config(memory_app("gone-1", safe_time_beat_shards=3)), data).beats_gone(sharded.gate.member)
    _run([single], clock, 2 * RENEW)
    assert single.held() == {0}
    later = _beat(data, clock, 3)
    _run([single, later], clock, 4 * RENEW)
    assert later.held() == set()
    assert single.held() == {0}


# --- SafeScheduler with shards --------------------------------------------------------------------


def _noop() -> None:
    return None


def _scheduler(tmp_path: Path, name: str, shards: int, clock: FakeTime | None = None) -> SafeScheduler:
    app = memory_app(
        "shard-sched",
        beat_schedule={"config-entry": {"task": "t.shard_noop", "schedule": 1.0}},
        safe_time_beat_shards=shards,
    )
    app.task(name="t.shard_noop", shared=False)(_noop)
    get_config(app)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / name), max_interval=1)
    for s in [sched, *sched.shard_children]:
        s.keeper._stop.set()  # the leases are driven by hand (``_attempt``), on the injected clock
    if sched.gate is not None and clock is not None:
        sched.gate._monotonic = clock
    return sched


def _keepers(sched: SafeScheduler) -> list[LeaderKeeper]:
    return [s.keeper for s in [sched, *sched.shard_children]]


def _attempt(scheds: list[SafeScheduler]) -> None:
    for sched in scheds:
        for keeper in _keepers(sched):
            keeper._stop.clear()
            keeper._attempt()
            keeper._stop.set()


def test_each_shard_fires_its_entries_once_and_a_moved_shard_continues_without_a_second_publish(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, on_dispatched: OnDispatched
) -> None:
    sent: list[tuple[str, float, int, Any]] = []

    def on_sent(sender: Any, entry: str, slot: Any, epoch: int, **kw: Any) -> None:
        sent.append((entry, slot.timestamp(), epoch, sender))

    on_dispatched(on_sent)
    names = [f"tenant-{i}" for i in range(12)]
    for name in names:
        data.definitions[name] = definition_json(name, "t.shard_noop", EVERY_SECOND, [], {}, {}, True)
    a = _scheduler(tmp_path, "a", 3, clock)
    b = _scheduler(tmp_path, "b", 3, clock)
    try:
        for _ in range(4):  # a took every shard at startup; b comes: a gives back one
            _attempt([a, b])
            clock.now += RENEW
        held_a = {k.shard for k in _keepers(a) if k.is_leader}
        held_b = {k.shard for k in _keepers(b) if k.is_leader}
        assert held_a | held_b == {0, 1, 2}
        assert not held_a & held_b
        assert held_b
        sent.clear()
        for _ in range(3):
            a.tick()
            b.tick()
            clock.now += 1.0
        by_entry = collections.defaultdict(list)
        for entry, slot, _, sender in sent:
            by_entry[entry].append(slot)
            # each entry fired by the scheduler of its own shard
            expected = 0 if entry == "config-entry" else shard_of(entry, 3)
            assert sender.shard == expected
        assert set(by_entry) == {*names, "config-entry"}
        assert all(len(set(slots)) == len(slots) for slots in by_entry.values())
        # b is killed (nothing released): after its lease a takes its shards over and goes on from the
        # slots b recorded; no slot of any entry is published twice
        clock.now += LEASE + 1.0
        for _ in range(3):
            _attempt([a])
            clock.now += 1.0
        assert all(k.is_leader for k in _keepers(a))
        for _ in range(3):
            a.tick()
            clock.now += 1.0
        seen = collections.Counter((entry, slot) for entry, slot, _, _ in sent)
        assert max(seen.values()) == 1
        moved = [n for n in names if shard_of(n, 3) in held_b]
        assert moved
        assert all(any(e == n and s > clock.now - 4 for e, s, _, _ in sent) for n in moved)
    finally:
        a.close()
        b.close()
    assert data.beats == {}  # each beat dropped its heartbeat on close


def test_one_shard_is_one_leader_as_before(tmp_path: Path, clock: FakeTime, data: MemoryBeatData) -> None:
    sched = _scheduler(tmp_path, "one", 1)
    try:
        assert sched.shard_children == []
        assert sched.gate is not None  # its heartbeat says K = 1 to any sharded beat
        assert sched.gate.shards == 1
        assert sched.keeper.lease_name == "the leader lease"
        assert sched.owns("anything")
    finally:
        sched.close()


def test_a_scheduler_that_fires_from_one_leader_refuses_shards_at_startup() -> None:
    """``SafeDatabaseScheduler`` (django-celery-beat rows) is a ``LeasedScheduler`` without shards."""
    from celery_safe_time.beat.base import LeasedScheduler

    one = LeasedScheduler()
    one.config = get_config(memory_app("one-leader", safe_time_beat_shards=2))
    with pytest.raises(ImproperlyConfigured, match=r"safe_time_beat_shards.*fires from one leader"):
        one.check_startup(1.0)


def test_held_shards_tick_at_their_own_cadence_while_a_standby_shard_is_looked_at_every_wake(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData
) -> None:
    """A beat that holds shard 0 and stands by for shard 1 (another beat holds it) comes back every
    ``BEAT_STANDBY_WAKE`` for the standby shard, but ticks the held shard only when its own wait is
    over (``max_interval`` here: nothing is due sooner), as one leader would."""
    from celery_safe_time import constants as C

    sched = _scheduler(tmp_path, "cadence", 2, clock)
    other = MemoryBeatBackend(sched.config, data).for_shard(1).make_lease()
    try:
        sched.shard_children[0].keeper.stop(release=True)  # it took every shard at startup
        assert other.acquire(clock.now) is not None  # shard 1 is another beat's
        _attempt([sched])
        assert [k.is_leader for k in _keepers(sched)] == [True, False]
        reads = collections.Counter[int]()
        for s in [sched, *sched.shard_children]:
            read_due = s.backend.read_due

            def counted(now: float, limit: int, _read: Any = read_due, _shard: int = s.shard) -> Any:
                reads[_shard] += 1
                return _read(now, limit)

            s.backend.read_due = counted  # type: ignore[method-assign]
        sched.tick()  # the first tick plans the held shard
        reads.clear()
        wakes = 0
        end = clock.now + 5.0
        while clock.now < end:
            wait = sched.tick()
            assert wait <= C.BEAT_STANDBY_WAKE  # the standby shard is looked at every wake
            # the test clock steps at least a millisecond: a wait of 1e-7, left by the float sum of the
            # 0.1 s wakes just before a due second, would otherwise tick again and again, a look each
            clock.now += max(wait, 0.001)
            wakes += 1
        assert wakes >= 5.0 / C.BEAT_STANDBY_WAKE - 1
        # about once a second (the config entry is due every second), not at each of the 50 wakes; a
        # second may take two looks: the held shard's wait ends a few microseconds before the entry's
        # score on the float sum of the wakes, the look finds nothing due and the next one fires it
        assert 4 <= reads[0] <= 12
        assert reads[1] == 0  # a standby shard makes no backend call
        # once the other beat's lease is gone and this beat takes shard 1, it ticks at once
        other.release()
        _attempt([sched])
        assert sched.shard_children[0].keeper.is_leader
        sched.tick()
        assert reads[1] == 1
    finally:
        sched.close()
