"""Safe Beat on PostgreSQL coordination with RabbitMQ as the broker and no Redis setting: three real
``celery beat`` processes, one leader, ``kill -9`` failover within lease + lease/3, no slot twice.

The worker's ``tests.record`` task still writes its run records to the test's Redis db (the test
harness's, not the package's); the beats never connect to Redis: their sockets are checked.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import Counter
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery

from celery_safe_time.beat.backends import SlotWrite, beat_backend
from celery_safe_time.config import get_config
from celery_safe_time.constants import COORDINATION_POOL_SIZE
from tests.helpers.beat import BEAT_APP, beat_env, coordination_settings, duplicates, runs
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
SCHEDULE = {
    "fast": {"task": "tests.record", "every": 1, "args": ["fast"]},
    "five": {"task": "tests.record", "every": 5, "args": ["five"]},
}


def _slot(run: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(run["headers"]["safe_time_slot"])).timestamp()


def _epochs(client: redis.Redis) -> set[int]:
    return {int(r["headers"]["safe_time_epoch"]) for r in runs(client)}


def _remote_ports(pid: int) -> Counter[int]:
    """How many connected sockets ``pid`` has to each remote TCP port (from /proc: no tool needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports: Counter[int] = Counter()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "01":  # ESTABLISHED
                ports[int(fields[2].rsplit(":", 1)[1], 16)] += 1
    return ports


@pytest.fixture
def pg_coordination(postgres_url: str) -> dict[str, str]:
    return coordination_settings(postgres_url)


def _start(
    processes: ProcessManager, amqp_url: str, redis_url: str, conf: dict[str, Any], n: int
) -> list[CeleryProcess]:
    app_conf = {**conf, "safe_time_beat_lease": LEASE, "result_backend": None}
    env = {
        **beat_env(SCHEDULE),
        "SAFE_TIME_TEST_BROKER_URL": amqp_url,
        "SAFE_TIME_TEST_RECORD_URL": redis_url,  # the run records only (the harness), never the package
        "SAFE_TIME_TEST_APP_CONF": json.dumps(app_conf),
    }
    processes.worker(BEAT_APP, env=env, name="worker")
    return [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(n)]


def _config_app(amqp_url: str, conf: dict[str, Any]) -> Celery:
    app = Celery("pgbeat", set_as_current=False)
    app.conf.update(broker_url=amqp_url, **conf)
    return app


def test_one_leader_of_three_and_kill_9_failover_without_redis(
    processes: ProcessManager,
    redis_client: redis.Redis,
    redis_url: str,
    amqp_url: str,
    pg_coordination: dict[str, str],
) -> None:
    app = _config_app(amqp_url, pg_coordination)
    config = get_config(app)
    assert config.redis_url == "", "no Redis is configured: nothing of the package may talk to one"
    backend = beat_backend(config)
    beats = _start(processes, amqp_url, redis_url, pg_coordination, 3)

    def leader() -> CeleryProcess | None:
        pid = backend.lease_view().info.get("pid")
        return next((b for b in beats if b.pid == pid), None)

    first = wait_for(leader, 60, message="a leader")
    wait_for(lambda: len(runs(redis_client, "five")) >= 2, 40, interval=0.5, message="two 'five' runs")
    # one leader: every run so far came from one epoch
    assert len(_epochs(redis_client)) == 1
    redis_port = urlsplit(redis_url).port or 6379
    pg_port = urlsplit(pg_coordination["safe_time_coordination_url"]).port or 5432
    for beat in beats:
        ports = _remote_ports(beat.pid)
        assert redis_port not in ports, f"{beat.name} connected to Redis"
        # one pooled engine per process: the lease thread's connection and the tick's, within the pool
        assert 1 <= ports[pg_port] <= COORDINATION_POOL_SIZE, f"{beat.name}: {ports[pg_port]} PostgreSQL connections"
        assert "postgresql" in beat.log()
        assert "redis://" not in beat.log()
    old_epochs = _epochs(redis_client)
    killed_at = time.time()
    first.kill()

    def new_epoch_run() -> dict[str, Any] | None:
        fresh = [r for r in runs(redis_client) if int(r["headers"]["safe_time_epoch"]) not in old_epochs]
        return fresh[0] if fresh else None

    taken = wait_for(new_epoch_run, 40, interval=0.2, message="a run from the new leader")
    # within lease + lease/3 (plus a little for the worker to pick the message up), as on Redis
    assert float(taken["started"]) - killed_at <= LEASE + LEASE / 3 + 3.0
    time.sleep(6)
    survivors = [b for b in beats if b is not first]
    acquired = sum("acquired the leader lease" in b.log() for b in survivors)
    assert acquired == 1, "exactly one standby took over"
    for beat in survivors:
        assert beat.alive()
    # The standby first: a leader stopped first releases its lease, which the standby would take
    # before its own shutdown (a third epoch that is the test's doing, not a failover's).
    for beat in sorted(survivors, key=lambda b: b is leader()):
        beat.terminate()
    last = -1
    while len(runs(redis_client)) != last:  # let the worker drain what was published
        last = len(runs(redis_client))
        time.sleep(2)
    assert duplicates(redis_client) == {}
    assert len(_epochs(redis_client)) == 2
    five = sorted(_slot(r) for r in runs(redis_client, "five"))
    assert all((b - a) % 5 == 0 and b > a for a, b in itertools.pairwise(five))
    fast = sorted(_slot(r) for r in runs(redis_client, "fast"))
    assert max(b - a for a, b in itertools.pairwise(fast)) <= LEASE + LEASE / 3 + 2
    # the epoch row survived and only moves forward
    view = backend.lease_view()
    assert view.epoch is not None
    assert view.epoch >= 2


def test_check_status_and_probe_on_postgres(make_app: Any, amqp_url: str, pg_coordination: dict[str, str]) -> None:
    from celery_safe_time.beat.admin import describe_beat
    from celery_safe_time.cli import probe_beat, run_checks

    app = make_app(broker_url=amqp_url, result_backend=None, safe_time_beat_lease=6, **pg_coordination)
    checks = {c.name: c for c in run_checks(app)}
    assert "redis" not in checks  # nothing of the package uses Redis here
    assert checks["coordination"].status == "ok", checks["coordination"]
    assert checks["clock_skew_coordination"].status == "ok"
    assert probe_beat(app).status == "fail"  # no beat holds the lease yet
    backend = beat_backend(get_config(app))
    lease = backend.make_lease()
    assert lease.acquire(backend.clock.time()) == 1
    assert lease.write_slots(1, [SlotWrite("e", '{"last": 100.0, "next": 110.0, "sig": "x"}', 110.0, 100.0)]) == [1]
    assert probe_beat(app).status == "ok"
    status = describe_beat(app)
    assert status["leader"]["pid"] == os.getpid()
    assert status["epoch"] == 1
    assert status["backend"].startswith("postgresql ")
    assert status["entries_total"] == 1
    assert status["entries"][0]["entry"] == "e"
    assert status["entries"][0]["last_slot"] == "1970-01-01T00:01:40+00:00"
