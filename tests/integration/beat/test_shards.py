"""Sharded firing (``safe_time_beat_shards``) with three real ``celery beat`` processes, on each beat
backend (``coordination``: Redis, PostgreSQL): every shard held, the shards shared out, each slot once,
and a ``kill -9``'d beat's shards taken over within lease + lease/3."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import get_entry, save_entries
from celery_safe_time.beat.backends import BeatBackend, beat_backend
from celery_safe_time.beat.shards import shard_of
from celery_safe_time.config import get_config
from tests.helpers.beat import BEAT_APP, beat_env, duplicates, runs, settle
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
SHARDS = 6
ENTRIES = 24


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _holders(shards: list[BeatBackend]) -> dict[int, int | None]:
    """Each shard's lease holder (its pid), None where free."""
    pids = {shard: backend.lease_view().info.get("pid") for shard, backend in enumerate(shards)}
    return {shard: int(pid) if pid is not None else None for shard, pid in pids.items()}


def _slots(client: redis.Redis, label: str) -> list[float]:
    return sorted(datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in runs(client, label))


def test_three_beats_share_the_shards_each_slot_once_and_a_killed_beats_shards_move(
    processes: ProcessManager, redis_client: redis.Redis, make_app: Callable[..., Celery], coordination: dict[str, Any]
) -> None:
    app = make_app(safe_time_beat_shards=SHARDS, **coordination)
    root = beat_backend(get_config(app))
    shards = [root.for_shard(shard) for shard in range(SHARDS)]
    app.task(name="tests.record", shared=False)(_noop)  # the name the beats' app registers
    names = [f"tenant-{i}" for i in range(ENTRIES)]
    save_entries([{"name": n, "task": "tests.record", "schedule": 1.0, "args": [n]} for n in names], app=app)
    assert {shard_of(n, SHARDS) for n in names} == set(range(SHARDS))  # every shard has entries
    env = beat_env(
        {"config-entry": {"task": "tests.record", "every": 1, "args": ["config-entry"]}},
        safe_time_beat_lease=LEASE,
        safe_time_beat_shards=SHARDS,
        **coordination,
    )
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(3)]
    pids = {b.pid for b in beats}

    def shared_out() -> bool:
        held = collections.Counter(_holders(shards).values())
        return set(held) == pids and all(count == SHARDS // 3 for count in held.values())

    wait_for(shared_out, 60, interval=0.2, message="each beat holding two shards")
    wait_for(lambda: all(len(runs(redis_client, n)) >= 3 for n in [*names, "config-entry"]), 30, message="runs")
    # each shard's entries were fired by the beat that held it (the epoch header is the shard's)
    holders = _holders(shards)
    victim = next(b for b in beats if b.pid == holders[SHARDS - 1])
    orphaned = {shard for shard, pid in holders.items() if pid == victim.pid}
    killed_at = time.time()
    victim.kill()
    survivors = pids - {victim.pid}

    def moved() -> float | None:
        now = _holders(shards)
        return time.time() if all(now[s] in survivors for s in orphaned) else None

    moved_at = wait_for(moved, 30, interval=0.05, message="the killed beat's shards to move")
    # a standby polls every lease/3 at most: within lease + lease/3 (plus the poll of this test)
    assert moved_at - killed_at <= LEASE + LEASE / 3 + 0.5, moved_at - killed_at
    held = collections.Counter(_holders(shards).values())
    assert set(held) == survivors
    assert sorted(held.values()) == [3, 3]
    # the moved shards' entries go on firing (from the new holders)
    after = time.time() + 2
    moved_names = [n for n in names if shard_of(n, SHARDS) in orphaned]
    wait_for(
        lambda: all(any(s > after for s in _slots(redis_client, n)) for n in moved_names),
        20,
        message="the moved shards' entries to fire again",
    )
    # the API reads each entry's next fire from its shard's keys
    assert all(get_entry(n, app=app).next_fire is not None for n in names)  # type: ignore[union-attr]
    for beat in beats:
        if beat is not victim:
            beat.terminate()
    settle(redis_client)
    assert duplicates(redis_client) == {}
    for name in names:  # the grid kept: one run per slot, whole seconds apart
        slots = _slots(redis_client, name)
        assert len(slots) == len(set(slots)) >= 5
        assert all(s == int(s) for s in slots)
    if coordination:  # the shards' own rows are apart: each shard's state holds only its entries
        for shard, backend in enumerate(shards):
            stored, _, _ = backend.read_all()
            assert {shard_of(n, SHARDS) for n in stored if n in names} <= {shard}
