"""Sharded firing (``safe_time_beat_shards``) as the operator sees it, on a real Redis: ``status``, the
beat probe, ``check``, the gauges and the Django overview show every shard and the live beats; two beats
with different K (in-process schedulers on the same Redis) do not both take shards, and ``check``
names the setting. (The Django overview's shard table: ``tests/integration/test_admin.py``.)"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import save_entries
from celery_safe_time.beat.admin import describe_beat
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.cli.status_commands import _shard_checks, run_probes
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

SHARDS = 3
LEASE = 3.0


def _noop(*args: Any) -> None:
    return None


@pytest.fixture
def sharded_app(make_app: Callable[..., Celery]) -> Celery:
    app = make_app("shard-views", safe_time_beat_shards=SHARDS, safe_time_beat_lease=LEASE)
    app.task(name="tests.shard_noop", shared=False)(_noop)
    save_entries([{"name": f"tenant-{i}", "task": "tests.shard_noop", "schedule": 3600.0} for i in range(12)], app=app)
    return app


@pytest.fixture
def beats(tmp_path: Path) -> Iterator[Callable[[Celery], SafeScheduler]]:
    """Start in-process beats (their lease threads run); each is closed at the end."""
    started: list[SafeScheduler] = []

    def start(app: Celery) -> SafeScheduler:
        sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / f"s{len(started)}"), max_interval=1)
        started.append(sched)
        return sched

    yield start
    for sched in started:
        sched.close()


def _held(sched: SafeScheduler) -> set[int]:
    return {s.shard for s in [sched, *sched.shard_children] if s.keeper.is_leader}


def test_status_probe_check_and_gauges_show_every_shard_and_the_beats(
    sharded_app: Celery, beats: Callable[[Celery], SafeScheduler]
) -> None:
    from prometheus_client import CollectorRegistry

    from celery_safe_time.metrics import register_gauges

    probe = run_probes(sharded_app, ["beat"])[0]
    assert probe.status == "fail"
    assert "no beat holds shard(s) 0, 1, 2 of 3" in probe.detail
    sched = beats(sharded_app)
    wait_for(lambda: _held(sched) == {0, 1, 2}, 10, message="the beat to hold every shard")
    # each shard plans its entries at its first tick, and fires their first slot (an interval's grid
    # starts where the leader first sees it) at the next
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        time.sleep(min(sched.tick(), 0.1))
    # the heartbeat says how many shards a beat holds from its next lease round on (every lease/3)
    wait_for(lambda: [b["held"] for b in describe_beat(sharded_app)["beats"]] == [3], 5, message="its heartbeat")
    section = describe_beat(sharded_app)
    rows = section["shards"]
    assert [row["shard"] for row in rows] == [0, 1, 2]
    assert all(row["pid"] == os.getpid() and row["epoch"] >= 1 and row["lease_left_s"] > 0 for row in rows)
    assert sum(row["scheduled"] for row in rows) == 12  # each shard's own due set (no config entries here)
    assert all(row["lag_s"] == 0.0 and row["due_now"] == 0 for row in rows), rows
    assert [(b["held"], b["shards_setting"], b["fires"]) for b in section["beats"]] == [(3, SHARDS, True)]
    probe = run_probes(sharded_app, ["beat"])[0]
    assert probe.status == "ok", probe.detail
    assert probe.detail.startswith("3 shards held by 1 beat(s), max lag 0.0s")
    (check,) = _shard_checks(sharded_app)
    assert check.status == "ok", check.detail
    registry = CollectorRegistry()
    register_gauges(sharded_app, registry)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}
    for shard in range(SHARDS):
        labels = (("host", rows[shard]["host"]), ("pid", str(os.getpid())), ("shard", str(shard)))
        assert samples[("safe_time_beat_shard_leader", labels)] == 1
        assert samples[("safe_time_beat_shard_epoch", (("shard", str(shard)),))] == rows[shard]["epoch"]
        assert samples[("safe_time_beat_shard_scheduled", (("shard", str(shard)),))] == rows[shard]["scheduled"]
        assert samples[("safe_time_beat_shard_lag_seconds", (("shard", str(shard)),))] == 0
    assert samples[("safe_time_beat_beats", (("shards", str(SHARDS)),))] == 1
    # one shard's lease lost (a beat closed, say): the probe names it
    sched.shard_children[1].keeper.stop(release=True)
    probe = run_probes(sharded_app, ["beat"])[0]
    assert probe.status == "fail"
    assert "no beat holds shard(s) 2 of 3" in probe.detail


def test_a_beat_with_another_k_takes_no_shard_and_check_names_the_setting(
    sharded_app: Celery,
    make_app: Callable[..., Celery],
    beats: Callable[[Celery], SafeScheduler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = beats(sharded_app)
    wait_for(lambda: _held(first) == {0, 1, 2}, 10, message="the first beat to hold every shard")
    other_app = make_app("shard-views-2", safe_time_beat_shards=2, safe_time_beat_lease=LEASE)
    other_app.task(name="tests.shard_noop", shared=False)(_noop)
    with caplog.at_level(logging.ERROR, logger="celery_safe_time.beat.shards"):
        second = beats(other_app)
        wait_for(
            lambda: "safe_time_beat_shards is 2 here but 3 on a live beat that started first" in caplog.text,
            10,
            message="the second beat's error",
        )
    # it would take a shard at once if it could: the first beat holds them all, so free one
    first.shard_children[0].keeper.stop(release=True)
    wait_for(lambda: len(describe_beat(sharded_app)["beats"]) == 2, 10, message="both heartbeats")
    section = describe_beat(sharded_app)
    assert sorted((b["shards_setting"], b["fires"]) for b in section["beats"]) == [(2, False), (3, True)]
    for _ in range(int(LEASE * 2 / 0.1)):  # two leases of the second beat's polls (every lease/3)
        assert _held(second) == set()
        first.tick()
        second.tick()
        time.sleep(0.1)
    (check,) = _shard_checks(sharded_app)
    assert check.status == "fail"
    assert "safe_time_beat_shards differs: 3 here, 2, 3 on the live beats" in check.detail
    # the first beat stops: the second one (K = 2) takes its shards
    first.close()
    wait_for(lambda: _held(second) == {0, 1}, 3 * LEASE, message="the second beat to take its two shards")
    (check,) = _shard_checks(other_app)
    assert check.status == "ok", check.detail
