"""Redis faults under Safe Beat: the lease key deleted, Redis restarted, Redis unreachable.

The beats keep their lease in a throwaway redis-server (``redis_server``) while tasks still
flow through the shared broker, so the broker is never the thing that breaks."""

from __future__ import annotations

import time

import pytest
import redis

from tests.helpers.beat import BEAT_APP, beat_env, duplicates, leader_pid, runs
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration

LEASE = 6.0
SCHEDULE = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}


def _start(processes: ProcessManager, server: RedisServer, n: int = 2) -> list[CeleryProcess]:
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE, safe_time_redis_url=server.url)
    processes.worker(BEAT_APP, env=env, name="worker")
    return [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(n)]


def _lease_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=2)


def _running(
    processes: ProcessManager, redis_client: redis.Redis, server: RedisServer
) -> tuple[list[CeleryProcess], redis.Redis]:
    """Two beats and a worker, once a leader fires: the beats and a client of the lease Redis."""
    beats = _start(processes, server)
    lease = _lease_client(server)
    wait_for(lambda: leader_pid(lease), 30, message="a leader")
    wait_for(lambda: len(runs(redis_client)) >= 2, 30, message="runs")
    return beats, lease


def _epochs_after(client: redis.Redis, since: float) -> set[int]:
    return {int(r["headers"]["safe_time_epoch"]) for r in runs(client) if float(r["started"]) > since}


def test_deleted_lease_key_one_leader_resumes(
    processes: ProcessManager, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    beats, lease = _running(processes, redis_client, redis_server)
    lease.delete("safe_time:beat:lease")
    deleted_at = time.time()
    wait_for(lambda: int(lease.get("safe_time:beat:epoch") or 0) >= 2, 30, message="a new epoch")
    time.sleep(LEASE)
    assert all(b.alive() for b in beats)
    assert any("lost the leader lease" in b.log() for b in beats)
    # the throwaway server runs without persistence: beat says so at startup
    assert "redis_persistence" in beats[0].log()
    assert len(_epochs_after(redis_client, deleted_at + LEASE / 2)) == 1
    assert duplicates(redis_client) == {}


def test_redis_restart_no_crash_one_leader(
    processes: ProcessManager, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    beats, lease = _running(processes, redis_client, redis_server)
    redis_server.restart()  # no persistence: the lease, epoch and state are gone
    restarted_at = time.time()
    wait_for(lambda: leader_pid(lease), 30, message="a leader after the restart")
    wait_for(lambda: runs(redis_client) and float(runs(redis_client)[-1]["started"]) > restarted_at + 1, 30)
    time.sleep(LEASE)
    assert all(b.alive() for b in beats)
    assert len(_epochs_after(redis_client, restarted_at + LEASE)) == 1
    assert duplicates(redis_client) == {}


def test_redis_unreachable_nothing_fires_then_resumes(
    processes: ProcessManager, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    beats, _lease = _running(processes, redis_client, redis_server)
    redis_server.stop()
    stopped_at = time.time()
    time.sleep(10)
    # allow for messages already in flight when Redis went away
    during = [r for r in runs(redis_client) if float(r["started"]) > stopped_at + 2]
    assert during == [], "something fired while the lease store was unreachable"
    redis_server.start()
    came_back = time.time()
    wait_for(lambda: any(float(r["started"]) > came_back for r in runs(redis_client)), 60, message="firing resumes")
    time.sleep(LEASE)
    assert all(b.alive() for b in beats)
    assert any("Redis unreachable" in b.log() for b in beats)
    assert len(_epochs_after(redis_client, came_back + LEASE)) == 1
    assert duplicates(redis_client) == {}


def test_unreachable_at_startup_fails_loudly(processes: ProcessManager) -> None:
    env = beat_env(SCHEDULE, safe_time_redis_url="redis://127.0.0.1:1/0")
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    assert beat.wait(60) != 0
    assert "unreachable at startup" in beat.log()
