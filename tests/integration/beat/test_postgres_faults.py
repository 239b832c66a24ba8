"""PostgreSQL coordination faults under Safe Beat: the database unreachable (a TCP proxy in front of
the shared server is cut: the server itself is never restarted, other sessions share it).

Fail closed: nothing fires while the database is gone; afterwards one leader resumes, no slot twice,
and the epoch goes on from where it was (it lives in a row: it never restarts)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers.beat import BEAT_APP, beat_env, coordination_settings, duplicates, holder_pid, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
SCHEDULE = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}


@pytest.fixture
def proxied(postgres_url: str) -> Iterator[tuple[TcpProxy, dict[str, Any]]]:
    proxy, url = proxy_for(postgres_url)
    yield proxy, coordination_settings(url)
    proxy.close()


def _epochs_after(client: redis.Redis, since: float) -> set[int]:
    return {int(r["headers"]["safe_time_epoch"]) for r in runs(client) if float(r["started"]) > since}


def test_database_unreachable_nothing_fires_then_one_leader_resumes(
    processes: ProcessManager, redis_client: redis.Redis, proxied: tuple[TcpProxy, dict[str, Any]]
) -> None:
    proxy, coordination = proxied
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(2)]
    wait_for(lambda: holder_pid(redis_client, coordination), 30, message="a leader")
    wait_for(lambda: len(runs(redis_client)) >= 2, 30, message="runs")
    # Both past their startup checks (a beat that cannot reach its database at startup exits): the
    # banner each logs once its keeper runs.
    for beat in beats:
        beat.wait_for_log(r"beat: safe-time -> (leader|standby)", timeout=60)
    before = _epochs_after(redis_client, 0.0)
    proxy.cut()
    cut_at = time.time()
    time.sleep(LEASE + 2)
    # fail closed: no beat can check the lease, so none publishes (2 s for the worker's backlog)
    assert [r for r in runs(redis_client) if float(r["started"]) > cut_at + 2] == []
    proxy.restore()
    came_back = time.time()
    wait_for(lambda: any(float(r["started"]) > came_back for r in runs(redis_client)), 60, message="firing resumes")
    time.sleep(LEASE + 2)
    for beat in beats:
        assert beat.alive()
    assert any("PostgreSQL" in b.log() and "unreachable" in b.log() for b in beats)
    # The standby first: a leader stopped first releases its lease, which the standby would take (a
    # second epoch after the outage that is the shutdown's doing).
    leader_pid = holder_pid(redis_client, coordination)
    for beat in sorted(beats, key=lambda b: b.pid == leader_pid):
        beat.terminate()
    time.sleep(2)
    assert duplicates(redis_client) == {}
    after = _epochs_after(redis_client, came_back + LEASE)
    assert len(after) == 1, "more than one leader after the outage"
    assert min(after) >= max(before), "the epoch went backwards"
