"""Schedule policies on real beats and a real worker, on each beat backend: jittered entries publish
each slot once at its computed offset, also across a ``kill -9`` of the leader."""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from typing import Any

import pytest
import redis

from celery_safe_time.beat.policies import jitter_offset
from tests.helpers.beat import BEAT_APP, beat_env, duplicates, holder_pid, published_slots, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 3
EVERY = 10
JITTER = 8.0
ENTRIES = [f"j{i}" for i in range(12)]
#: publish to a worker's start: the tick (up to 1 s), the broker and the worker's pickup on a loaded
#: machine (4.2 s seen with the whole suite on two cores); below the 10 s interval, so a slot held
#: back to its next one still fails
PICKUP = 8.0


def _slot(run: dict[str, Any]) -> float:
    return datetime.fromisoformat(run["headers"]["safe_time_slot"]).timestamp()


def test_jittered_entries_fire_once_each_at_their_offsets_across_a_kill_9(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    schedule = {n: {"task": "tests.record", "every": EVERY, "args": [n], "jitter": JITTER} for n in ENTRIES}
    env = beat_env(schedule, safe_time_beat_lease=LEASE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(2)]
    pid = wait_for(lambda: holder_pid(redis_client, coordination), 30, message="a leader")
    leader = next(b for b in beats if b.pid == pid)
    wait_for(lambda: all(len(runs(redis_client, n)) >= 2 for n in ENTRIES), 60, message="two runs of each entry")
    killed_at = time.time()
    leader.kill()
    standby = next(b for b in beats if b is not leader)
    after = killed_at + LEASE + LEASE / 3 + 2  # the standby leads by then
    wait_for(
        lambda: all(sum(_slot(r) > after for r in runs(redis_client, n)) >= 2 for n in ENTRIES),
        60,
        message="two runs of each entry from the new leader",
    )
    standby.terminate()
    time.sleep(1)  # the last published runs are recorded
    assert duplicates(redis_client) == {}
    epochs: set[int] = set()
    for name in ENTRIES:
        mine = runs(redis_client, name)
        slots = sorted(_slot(r) for r in mine)
        # the entry's grid, every slot once: none lost to the failover (at most one in its window,
        # published late by the new leader, on time or as run_once's catch-up)
        assert all(b - a == EVERY for a, b in itertools.pairwise(slots)), (name, slots)
        for run in mine:
            slot = _slot(run)
            offset = jitter_offset(name, slot, JITTER)
            started = float(run["started"])
            epochs.add(int(run["headers"]["safe_time_epoch"]))
            # never before its jittered instant; at it, unless the failover held it back
            assert started >= slot + offset - 0.05, (name, slot, started - slot, offset)
            if not killed_at - PICKUP < slot + offset < after:
                assert started < slot + offset + PICKUP, (name, slot, started - slot, offset)
    assert len(epochs) >= 2  # both leaders published
    offsets = {round(jitter_offset(n, s, JITTER)) for n in ENTRIES for s in {_slot(r) for r in runs(redis_client, n)}}
    assert len(offsets) > 4  # spread over the window, not all at the slot


def test_a_catch_up_window_skips_the_slots_missed_longer_ago_after_every_beat_was_down(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    every = 3
    schedule = {
        name: {"task": "tests.record", "every": every, "args": [name], "options": {"safe_time_misfire": "run_all"},
               **extra}
        for name, extra in {"windowed": {"catchup_window": 7}, "all": {}}.items()
    }  # fmt: skip
    env = beat_env(schedule, safe_time_beat_lease=LEASE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    first = processes.beat(BEAT_APP, env=env, name="first")
    wait_for(lambda: all(runs(redis_client, n) for n in schedule), 30, message="the first slot of each entry")
    first.terminate()
    # The last slot the first beat published, from its log: the runs recorded so far can lag behind
    # it on a loaded machine (the worker still running it), and the beats would be down one slot less.
    last = max(published_slots(first.log(), "all"))
    time.sleep(max(0.0, last + 6 * every + 1 - time.time()))  # every beat down across six slots
    second = processes.beat(BEAT_APP, env=env, name="second")
    found = second.wait_for_log(r"entry 'windowed' skipped (\d+) slot\(s\) up to \S+: later than its catch-up", 60)
    started = time.time()
    wait_for(lambda: any(_slot(r) > started for r in runs(redis_client, "windowed")), 30, message="an on-time slot")
    second.terminate()
    sent = {n: set(published_slots(first.log() + second.log(), n)) for n in schedule}

    def recorded() -> bool:
        return all(sent[n] <= {_slot(r) for r in runs(redis_client, n)} for n in schedule)

    wait_for(recorded, 30, message="a run of every published slot")
    assert duplicates(redis_client) == {}
    windowed = sorted(_slot(r) for r in runs(redis_client, "windowed"))
    everything = sorted(_slot(r) for r in runs(redis_client, "all"))
    # run_all without a window publishes every missed slot: the grid has no hole
    assert all(b - a == every for a, b in itertools.pairwise(everything)), everything
    # with the window, the missed slots older than 7 s when the second beat looked were skipped
    skipped = int(found.group(1))
    assert skipped >= 4, second.log()
    holes = [b - a for a, b in itertools.pairwise(windowed) if b - a > every]
    assert holes == [every * (skipped + 1)], (windowed, skipped)
