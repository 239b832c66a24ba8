"""``celery safe-time locks list|release`` and the ``[locks]`` status section."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import LockBackend, Owner, get_lock_backend
from celery_safe_time.locks.backends.redis import RedisLockBackend
from tests.helpers import locks as h
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration

APP = "tests.apps.locks_app"


def _hold(store: LockBackend, key: str, task_id: str) -> None:
    owner = Owner(task_id=task_id, identity=f"{task_id}:0:0", host="worker-host", pid=99)
    assert store.acquire(key, "tok-" + task_id, 60, owner).status == "acquired"


def test_locks_list_release_and_status(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    store = RedisLockBackend(redis_client, get_config(make_app()))
    held_at = time.monotonic()
    _hold(store, "inventory-sync:1", "task-1")
    _hold(store, "inventory-sync:2", "task-2")
    _hold(store, "report:9", "task-9")

    listed = processes.cli(APP, "safe-time", "locks", "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["KEY", "TASK", "ID", "STATE", "HOST", "PID", "FENCE", "AGE", "TTL", "LEFT"]
    assert [line.split()[0] for line in lines[1:]] == ["inventory-sync:1", "inventory-sync:2", "report:9"]
    assert "task-1" in lines[1]
    assert "worker-host" in lines[1]
    assert "tok-" not in listed.stdout

    filtered = processes.cli(APP, "safe-time", "locks", "list", "--pattern", "inventory-sync:*", "--json")
    assert filtered.returncode == 0, filtered.stderr
    rows = json.loads(filtered.stdout)
    assert [r["key"] for r in rows] == ["inventory-sync:1", "inventory-sync:2"]
    assert rows[0]["task_id"] == "task-1"
    # measured from the hold: each `celery` subprocess takes seconds to start on a loaded machine
    elapsed = time.monotonic() - held_at
    assert 60 - elapsed - 1 <= rows[0]["ttl_left"] <= 60
    assert rows[0]["age"] <= elapsed + 1

    refused = processes.cli(APP, "safe-time", "locks", "release", "report:9")
    assert refused.returncode == 2
    assert "--yes" in refused.stderr
    assert redis_client.exists("safe_time:lock:report:9")

    released = processes.cli(APP, "safe-time", "locks", "release", "report:9", "--yes")
    assert released.returncode == 0, released.stderr
    assert "released report:9 (held by task-9 on worker-host" in released.stdout
    assert not redis_client.exists("safe_time:lock:report:9")
    missing = processes.cli(APP, "safe-time", "locks", "release", "report:9", "--yes")
    assert missing.returncode == 1

    status = processes.cli(APP, "safe-time", "status", "--json")
    assert status.returncode == 0, status.stderr
    section = json.loads(status.stdout)["locks"]
    assert section["held"] == 2
    assert [lock["key"] for lock in section["locks"]] == ["inventory-sync:1", "inventory-sync:2"]


def test_status_shows_flow_control(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    from celery_safe_time.locks.rates import Rate

    store = RedisLockBackend(redis_client, get_config(make_app()))
    _hold(store, "slot:export:3#0", "task-a")
    _hold(store, "slot:export:3#2", "task-b")
    _hold(store, "report:9", "task-9")  # a plain lock is not a slot
    for n in range(3):
        store.rate_take("stripe:5", f"t{n}", Rate(2, 60.0))
    status = processes.cli(APP, "safe-time", "status", "--json")
    assert status.returncode == 0, status.stderr
    flow = json.loads(status.stdout)["flow"]
    assert flow["slots_held"] == 2
    assert flow["concurrency"] == [{"key": "export:3", "held": 2, "slots": ["slot:export:3#0", "slot:export:3#2"]}]
    assert flow["rates"] == [{"key": "stripe:5", "started": 2, "waiting": 1}]
    assert flow["waiting"] == 1
    text = processes.cli(APP, "safe-time", "status")
    assert text.returncode == 0, text.stderr
    assert "[flow]" in text.stdout
    assert "stripe:5" in text.stdout


def test_locks_list_uses_scan_not_keys(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    # a Redis of our own: command statistics on the shared one count other sessions' commands
    client = redis.Redis.from_url(redis_server.url)
    store = RedisLockBackend(client, get_config(make_app(safe_time_redis_url=redis_server.url)))
    for n in range(1200):
        _hold(store, f"bulk:{n}", f"t{n}")
    client.set("safe_time:lock-fence:unrelated", 1)
    client.config_resetstat()
    conf = json.dumps({"safe_time_redis_url": redis_server.url})
    listed = processes.cli(APP, "safe-time", "locks", "list", "--json", env={"SAFE_TIME_TEST_APP_CONF": conf})
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 1200
    stats = client.info("commandstats")
    assert "cmdstat_keys" not in stats
    assert stats["cmdstat_scan"]["calls"] >= 2
    client.close()


def test_released_holder_is_told_at_its_next_renewal(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis
) -> None:
    h.start_worker(processes, ttl=1.5, concurrency=4)
    client = h.client_app(redis_url)
    run = client.send_task("locks.hold", args=("stuck", 20))
    wait_for(lambda: redis_client.get(f"test:locks:started:{run.id}"), 30, message="hold started")
    released = processes.cli(APP, "safe-time", "locks", "release", "hold:stuck", "--yes")
    released_at = time.time()
    assert released.returncode == 0, released.stderr
    [record] = h.wait_runs(redis_client, "hold", 1, timeout=10)
    assert record["outcome"] == "lost"
    # told within ttl/3 of the release, not after 20 s. Measured from the command's return: starting a
    # `celery` subprocess alone takes seconds on a loaded machine.
    assert record["finished"] < released_at + 3
    assert record["finished"] - record["started"] < 19
    client.close()


def test_locks_list_shows_unique_keys_with_task_id_and_state_and_release_frees_one(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    store = RedisLockBackend(redis_client, get_config(make_app()))
    _hold(store, "inventory-sync:1", "task-1")
    taken = time.monotonic()
    claim = store.unique_acquire("export:7", "task-7", 600, "queued", stored=False, host="caller-host")
    assert claim.status == "acquired"
    store.unique_acquire("export:8", "task-8", 600, "stored", stored=True, host="caller-host")

    listed = processes.cli(APP, "safe-time", "locks", "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["inventory-sync:1", "unique:export:7", "unique:export:8"]
    assert lines[2].split()[:3] == ["unique:export:7", "task-7", "queued"]
    assert lines[3].split()[:3] == ["unique:export:8", "task-8", "stored"]

    only = processes.cli(APP, "safe-time", "locks", "list", "--pattern", "unique:export:7", "--json")
    rows = json.loads(only.stdout)
    assert [(r["key"], r["task_id"], r["state"], r["kind"]) for r in rows] == [
        ("unique:export:7", "task-7", "queued", "unique")
    ]
    # the ttl counts down from the claim (subprocesses are slow on a loaded machine: measure, not guess)
    assert 600 - (time.monotonic() - taken) - 1 <= rows[0]["ttl_left"] <= 600

    released = processes.cli(APP, "safe-time", "locks", "release", "unique:export:7", "--yes")
    assert released.returncode == 0, released.stderr
    assert "released unique:export:7 (held by task-7, queued" in released.stdout
    assert not redis_client.exists("safe_time:unique:export:7")
    assert redis_client.exists("safe_time:unique:export:8")

    status = processes.cli(APP, "safe-time", "status", "--json")
    assert status.returncode == 0, status.stderr
    section = json.loads(status.stdout)["locks"]
    assert section["unique_held"] == 1
    assert [(k["key"], k["task_id"], k["state"]) for k in section["unique"]] == [
        ("unique:export:8", "task-8", "stored")
    ]


def test_check_and_locks_commands_on_postgres_coordination(
    processes: ProcessManager,
    redis_url: str,
    amqp_url: str,
    postgres_coordination_url: str,
    make_app: Callable[..., Celery],
) -> None:
    """RabbitMQ broker, locks on PostgreSQL, no Redis setting: ``check`` reports the lock database (and
    no Redis check), ``locks list`` and ``locks release`` read and delete the rows."""
    conf = {"safe_time_coordination_url": postgres_coordination_url}
    store = get_lock_backend(make_app(broker_url=amqp_url, **conf))
    env = h.broker_env(amqp_url, redis_url, coordination=conf)

    checked = processes.cli(APP, "safe-time", "check", "--json", env=env)
    names = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
    assert "redis" not in names
    assert names["locks_postgres"]["status"] == "ok", names
    assert "lease locks" in names["locks_postgres"]["detail"]

    _hold(store, "inventory-sync:1", "task-1")
    store.unique_acquire("export:7", "task-7", 60, "queued", stored=False, host="web-1")
    listed = processes.cli(APP, "safe-time", "locks", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["key"], r["task_id"], r["kind"]) for r in rows] == [
        ("inventory-sync:1", "task-1", "overlap"),
        ("unique:export:7", "task-7", "unique"),
    ]
    assert "tok-" not in listed.stdout
    released = processes.cli(APP, "safe-time", "locks", "release", "inventory-sync:1", "--yes", env=env)
    assert released.returncode == 0, released.stderr
    assert "held by task-1 on worker-host" in released.stdout
    assert store.token_of("inventory-sync:1") is None
