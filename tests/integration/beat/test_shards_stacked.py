"""Sharded firing with stacked gates on the tasks: three real ``celery beat`` processes share three
shards of runtime entries whose task takes an overlap lock (per entry) over a concurrency limit (two
runs at once of all entries, so slots are re-queued), a real worker runs them, and one beat is
``kill -9``'d in the middle. Each slot runs at most once; the only slots missing are those of the
killed beat's shards while they moved (lease + lease/3, docs/beat.md "Failover")."""

from __future__ import annotations

import collections
import itertools
import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import save_entries
from celery_safe_time.beat.shards import shard_of
from tests.helpers.beat import BEAT_APP, beat_env, duplicates, runs, settle
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 4.0
SHARDS = 3
EVERY = 2.0
ENTRIES = 9


def _noop(*args: Any) -> None:
    return None


def _info_key(shard: int) -> str:
    return "safe_time:beat:leader" if shard == 0 else f"safe_time:beat:shard:{shard}:leader"


def _holders(client: redis.Redis) -> dict[int, int | None]:
    raws = client.mget([_info_key(shard) for shard in range(SHARDS)])
    return {shard: int(json.loads(raw)["pid"]) if raw else None for shard, raw in enumerate(raws)}


def _slots(client: redis.Redis, label: str) -> list[float]:
    return sorted(datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in runs(client, label))


def test_sharded_beats_fire_stacked_gate_tasks_each_slot_once_across_a_kill(
    processes: ProcessManager, redis_client: redis.Redis, make_app: Callable[..., Celery]
) -> None:
    app = make_app(safe_time_beat_shards=SHARDS)
    app.task(name="tests.stacked_run", shared=False)(_noop)  # the name the beats' app registers
    names = [f"stacked-{i}" for i in range(ENTRIES)]
    save_entries([{"name": n, "task": "tests.stacked_run", "schedule": EVERY, "args": [n]} for n in names], app=app)
    assert {shard_of(n, SHARDS) for n in names} == set(range(SHARDS))
    env = beat_env({}, safe_time_beat_lease=LEASE, safe_time_beat_shards=SHARDS)
    processes.worker(BEAT_APP, env=env, name="worker", concurrency=4)
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(3)]
    pids = {b.pid for b in beats}

    def shared_out() -> bool:
        held = collections.Counter(_holders(redis_client).values())
        return set(held) == pids and set(held.values()) == {1}

    wait_for(shared_out, 60, interval=0.2, message="each beat holding one shard")
    wait_for(lambda: all(len(runs(redis_client, n)) >= 3 for n in names), 60, message="three runs of each entry")
    holders = _holders(redis_client)
    victim_shard = next(s for s in range(1, SHARDS))
    victim = next(b for b in beats if b.pid == holders[victim_shard])
    killed_at = time.time()
    victim.kill()
    survivors = pids - {victim.pid}
    moved_at = wait_for(
        lambda: time.time() if _holders(redis_client)[victim_shard] in survivors else None,
        30,
        interval=0.05,
        message="the killed beat's shard to move",
    )
    assert moved_at - killed_at <= LEASE + LEASE / 3 + 0.5, moved_at - killed_at
    after = moved_at + 2 * EVERY
    wait_for(
        lambda: all(any(s > after for s in _slots(redis_client, n)) for n in names),
        60,
        message="every entry firing again after the move",
    )
    stopped_at = time.time()
    for beat in beats:
        if beat is not victim:
            beat.terminate()
    settle(redis_client, quiet=3.0)
    assert duplicates(redis_client) == {}, "a slot ran twice"
    # the concurrency limit held across the beats' bursts: never more than two runs at once, so slots
    # were re-queued behind it (and each still ran once)
    edges = sorted(e for r in runs(redis_client) for e in ((r["started"], 1), (r["finished"], -1)))
    running = list(itertools.accumulate(step for _, step in edges))
    assert max(running) == 2, max(running)
    # nothing lost but the moved shard's slots while it moved: each entry's grid is whole (slots EVERY
    # apart) outside [the kill, the move]; a missed slot runs once late (the default misfire policy)
    for name in names:
        slots = _slots(redis_client, name)
        assert len(slots) == len(set(slots))
        gaps = [(a, b) for a, b in itertools.pairwise(slots) if b - a > EVERY + 0.001]
        for a, b in gaps:
            assert shard_of(name, SHARDS) == victim_shard, (name, a, b)
            assert killed_at - EVERY <= a, (name, a - killed_at)
            assert b <= moved_at + 2 * EVERY, (name, b - moved_at)
        assert slots[-1] >= stopped_at - 3 * EVERY - LEASE  # fired up to the end, by the surviving beats
