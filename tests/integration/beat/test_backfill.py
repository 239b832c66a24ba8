"""``celery safe-time beat backfill`` through the real ``celery`` command and a real worker, on each
beat backend: every unfired slot of the range once, nothing on a second run, and a leader catching up
the same slots (misfire ``run_all``) publishes none of them again."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from tests.helpers.beat import BEAT_APP, beat_env, duplicates, published_slots, runs
from tests.helpers.processes import ROOT, ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 3
EVERY = 2
SCHEDULE = {
    "hourly": {"task": "tests.record", "cron": {"minute": "0"}, "args": ["hourly"], "options": {"queue": "celery"}},
    "fast": {"task": "tests.record", "every": EVERY, "args": ["fast"], "options": {"safe_time_misfire": "run_all"}},
    # a 1 s task on an hourly grid: a backfill publishes its slots at once, so runs would overlap
    "chained": {"task": "tests.overlap_run", "cron": {"minute": "0"}, "args": ["chained", 1.0]},
    "skipped": {"task": "tests.overlap_run", "cron": {"minute": "0"}, "args": ["skipped", 1.0], "overlap": "skip"},
}


def _slot(run: dict[str, Any]) -> float:
    return datetime.fromisoformat(run["headers"]["safe_time_slot"]).timestamp()


def _backfill(
    processes: ProcessManager, env: dict[str, str], name: str, start: datetime, end: datetime, *extra: str
) -> subprocess.CompletedProcess[str]:
    args = ("safe-time", "beat", "backfill", name, "--from", start.isoformat(), "--to", end.isoformat(), *extra)
    return processes.cli(BEAT_APP, *args, env=env)


def test_a_backfill_of_24_hourly_slots_publishes_24_then_none(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    env = beat_env(SCHEDULE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=24)
    first = _backfill(processes, env, "hourly", start, end, "--json")
    assert first.returncode == 0, first.stderr
    published = json.loads(first.stdout)["published"]
    assert published == [(start + timedelta(hours=h)).isoformat() for h in range(24)]
    wait_for(lambda: len(runs(redis_client, "hourly")) >= 24, 60, message="24 backfilled runs")
    again = _backfill(processes, env, "hourly", start - timedelta(hours=1), end)
    assert again.returncode == 0, again.stderr
    # the hour before the range was never fired: it is the only slot published
    assert again.stdout.splitlines() == [
        f"hourly: published slot {(start - timedelta(hours=1)).isoformat()}",
        "hourly: 1 slot(s) published",
    ]
    wait_for(lambda: len(runs(redis_client, "hourly")) >= 25, 60, message="the 25th run")
    third = _backfill(processes, env, "hourly", start - timedelta(hours=1), end)
    assert third.stdout.strip() == "hourly: 0 slot(s) published", third.stderr
    assert duplicates(redis_client) == {}
    recorded = runs(redis_client, "hourly")
    assert sorted(_slot(r) for r in recorded) == [(start + timedelta(hours=h)).timestamp() for h in range(-1, 24)]
    assert all(r["headers"]["safe_time_backfill"].startswith("backfill:") for r in recorded)


def test_three_concurrent_backfills_of_one_range_publish_each_slot_once(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    env = beat_env(SCHEDULE, **coordination)
    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=24)
    cmd = [sys.executable, "-m", "celery", "-A", BEAT_APP, "safe-time", "beat", "backfill", "hourly"]
    cmd += ["--from", start.isoformat(), "--to", end.isoformat(), "--json"]
    full_env = {**os.environ, **processes.env, **env, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    published = [json.loads(out)["published"] for out, _ in outputs]
    every = [slot for one in published for slot in one]
    assert sorted(every) == [(start + timedelta(hours=h)).isoformat() for h in range(24)], published
    processes.worker(BEAT_APP, env=env, name="worker")
    wait_for(lambda: len(runs(redis_client, "hourly")) >= 24, 60, message="24 runs")
    time.sleep(1)  # a duplicate would be recorded by now
    assert len(runs(redis_client, "hourly")) == 24
    assert duplicates(redis_client) == {}


def test_bad_input_is_refused_with_a_clear_error(processes: ProcessManager, coordination: dict[str, Any]) -> None:
    env = beat_env(SCHEDULE, **coordination)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    backwards = _backfill(processes, env, "hourly", now, now - timedelta(hours=1))
    assert backwards.returncode == 1
    assert "is not after the start" in backwards.stderr
    unknown = _backfill(processes, env, "nope", now - timedelta(hours=1), now)
    assert unknown.returncode == 1
    assert "no beat entry 'nope'" in unknown.stderr
    too_many = _backfill(processes, env, "hourly", now - timedelta(days=3), now, "--max", "10")
    assert too_many.returncode == 1
    assert "72 slots in the range, more than the limit of 10" in too_many.stderr
    future = _backfill(processes, env, "hourly", now - timedelta(hours=1), now + timedelta(hours=1))
    assert future.returncode == 1
    assert "is in the future" in future.stderr
    garbled = processes.cli(
        BEAT_APP, "safe-time", "beat", "backfill", "hourly", "--from", "yesterday", "--to", now.isoformat(), env=env
    )
    assert garbled.returncode == 2
    assert "expected an ISO 8601 instant" in garbled.stderr


def test_a_leader_does_not_publish_a_backfilled_slot_again(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    env = beat_env({"fast": SCHEDULE["fast"]}, safe_time_beat_lease=LEASE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    first = processes.beat(BEAT_APP, env=env, name="first")
    wait_for(lambda: runs(redis_client, "fast"), 30, message="a first run")
    first.terminate()
    # The last slot the beat published, from its log: the runs recorded so far can lag behind it (a
    # worker that started after the beat was still running the last one on a loaded CI).
    last = max(published_slots(first.log(), "fast"))
    time.sleep(max(0.0, last + 4 * EVERY + 0.5 - time.time()))  # no beat across four slots
    end = datetime.now(timezone.utc)
    filled = _backfill(processes, env, "fast", datetime.fromtimestamp(last, timezone.utc), end, "--json")
    assert filled.returncode == 0, filled.stderr
    backfilled = json.loads(filled.stdout)["published"]
    assert len(backfilled) >= 4, filled.stdout  # the missed slots; the last fired one is not among them
    # the next leader catches the missed slots up (run_all): the backfilled ones are fired already
    second = processes.beat(BEAT_APP, env=env, name="second")
    second.wait_for_log(r"entry 'fast' slot \S+ was already fired; not publishing it again", 60)
    # and backfills racing the leader on its latest slots publish each slot once between them
    for _ in range(3):
        now = datetime.now(timezone.utc)
        raced = _backfill(processes, env, "fast", now - timedelta(seconds=6), now)
        assert raced.returncode == 0, raced.stderr
    stopped = time.time()
    wait_for(lambda: any(_slot(r) > stopped for r in runs(redis_client, "fast")), 30, message="a run after the races")
    second.terminate()
    time.sleep(1)  # the last published runs are recorded
    assert duplicates(redis_client) == {}
    slots = sorted(_slot(r) for r in runs(redis_client, "fast"))
    # one grid, every slot once: none lost between the backfill and the leader, none twice
    assert all(b - a == EVERY for a, b in itertools.pairwise(slots)), slots
    from_backfill = {
        r["headers"]["safe_time_slot"] for r in runs(redis_client, "fast") if "safe_time_backfill" in r["headers"]
    }
    assert set(backfilled) <= from_backfill


def test_a_backfill_runs_its_slots_through_an_overlap_policy(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    from tests.integration.beat.test_overlap import _ended, _events, _max_running

    env = beat_env(SCHEDULE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker", concurrency=2)
    end = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=6)
    chained = _backfill(processes, env, "chained", start, end, "--overlap", "buffer_all", "--json")
    assert chained.returncode == 0, chained.stderr
    assert json.loads(chained.stdout) == {
        "entry": "chained",
        "published": [(start + timedelta(hours=h)).isoformat() for h in range(6)],
        "dropped": [],
    }
    # the entry's own policy (skip): the first slot runs, the other five are dropped while it is queued
    skipped = _backfill(processes, env, "skipped", start, end)
    assert skipped.returncode == 0, skipped.stderr
    lines = skipped.stdout.splitlines()
    assert lines[0] == f"skipped: published slot {start.isoformat()}", lines
    assert lines[-1] == "skipped: 1 slot(s) published", lines
    assert sum("(overlap policy)" in line for line in lines) == 5, lines
    wait_for(lambda: _ended(_events(redis_client, "chained")) >= 6, 90, message="six chained runs")
    events = _events(redis_client, "chained")
    assert _max_running(events) == 1, events
    published = [e["task_id"] for e in events if e["event"] == "publish"]
    started = [e["task_id"] for e in events if e["event"] == "start"]
    assert len(published) == 6
    assert started == published, (published, started)  # one at a time, in slot order
    wait_for(lambda: _ended(_events(redis_client, "skipped")) >= 1, 30, message="the skipped entry's run")
    # the run history shows the dropped slots; a second backfill publishes none of them
    again = _backfill(processes, env, "skipped", start, end, "--json")
    assert json.loads(again.stdout) == {"entry": "skipped", "published": [], "dropped": []}, again.stderr

    def outcomes() -> list[str]:
        shown = processes.cli(BEAT_APP, "safe-time", "beat", "show", "skipped", env=env)
        assert shown.returncode == 0, shown.stderr
        return sorted(run["outcome"] for run in json.loads(shown.stdout)["runs"])

    # the worker writes the run's outcome just after its end
    wait_for(lambda: outcomes() == ["dropped"] * 5 + ["succeeded"], 30, message="the outcomes in the run history")
