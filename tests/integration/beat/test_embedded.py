"""Embedded beat on two workers, and the status command.

The worker's ``-S`` is ``--statedb``: embedded beat takes ``--scheduler celery_safe_time.SafeScheduler``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import redis

from tests.helpers.beat import BEAT_APP, beat_env, duplicates, leader_pid, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
SCHEDULE = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}


def test_two_embedded_beats_one_fires_and_fails_over(processes: ProcessManager, redis_client: redis.Redis) -> None:
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE)
    workers = [
        processes.worker(
            BEAT_APP,
            "-B",
            "--scheduler",
            "celery_safe_time.SafeScheduler",
            "-s",
            str(processes.log_dir / f"w{i}-schedule"),
            name=f"w{i}",
            env=env,
        )
        for i in range(2)
    ]
    pid = wait_for(lambda: leader_pid(redis_client), 60, message="an embedded leader")
    wait_for(lambda: len(runs(redis_client)) >= 5, 30, message="runs")
    leading = next(w for w in workers if os.getpgid(pid) == w.pid)
    other = next(w for w in workers if w is not leading)
    epochs_before = {r["headers"]["safe_time_epoch"] for r in runs(redis_client)}
    assert len(epochs_before) == 1
    killed_at = time.time()
    leading.kill()
    wait_for(lambda: (p := leader_pid(redis_client)) is not None and p != pid, 30, message="the other beat leads")
    assert os.getpgid(leader_pid(redis_client) or 0) == other.pid

    def fresh() -> list[dict[str, object]]:
        return [r for r in runs(redis_client) if r["headers"]["safe_time_epoch"] not in epochs_before]

    wait_for(fresh, 30, message="a run from the new leader")
    assert float(fresh()[0]["started"]) - killed_at <= LEASE + LEASE / 3 + 3.0
    time.sleep(3)
    other.terminate()
    assert duplicates(redis_client) == {}


def test_status_shows_leader_and_entries(processes: ProcessManager, redis_client: redis.Redis) -> None:
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE)
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    wait_for(lambda: redis_client.zcard("safe_time:beat:due"), 30, message="entries in Redis")
    out = processes.cli(BEAT_APP, "safe-time", "status", "--json", env=env)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)["beat"]
    assert status["leader"]["pid"] == beat.pid
    assert status["leader"]["epoch"] == 1
    assert 0 < status["leader"]["lease_left_s"] <= LEASE
    assert [e["entry"] for e in status["entries"]] == ["fast"]
    assert status["entries"][0]["next_slot"]
    text = processes.cli(BEAT_APP, "safe-time", "status", env=env)
    assert "[beat]" in text.stdout
    # the banner says who holds the lease; the first log line says what this beat became
    assert ". safe-time -> lease free: this beat will take it; lease 6s" in beat.log()
    assert "safe-time -> leader (epoch 1)" in beat.log()


def test_embedded_beat_releases_the_lease_on_worker_shutdown(
    processes: ProcessManager, redis_client: redis.Redis
) -> None:
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE)
    worker = processes.worker(
        BEAT_APP, "-B", "--scheduler", "celery_safe_time.SafeScheduler", "-s", str(processes.log_dir / "w-schedule"),
        name="w", env=env,
    )  # fmt: skip
    wait_for(lambda: leader_pid(redis_client), 60, message="an embedded leader")
    wait_for(lambda: runs(redis_client), 30, message="a run")
    worker.terminate()
    assert "released the leader lease" in worker.log()
    assert redis_client.get("safe_time:beat:lease") is None
