"""The Redis-backed core on a plain Redis, on a 3-master Redis Cluster the tests start themselves, and
on Valkey (a server and a cluster).

Every test here runs twice (``topology``): on the session's Redis db and on the session cluster
(``redis_cluster``: three masters, three replicas, loopback ports); ``test_valkey.py`` runs them on a
Valkey server and a Valkey cluster (``valkey_node``, ``valkey_cluster``). Tasks still flow through the
Redis broker: only ``safe_time_redis_url`` (leases, fired markers, runtime entries, locks,
idempotency and finished-delivery markers) points at the cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import (
    delete_entry,
    entry_audit,
    entry_history,
    get_entry,
    idempotent,
    list_entries,
    overlap_lock,
    save_entry,
    signals,
)
from celery_safe_time.beat.backends.base import SlotWrite
from celery_safe_time.beat.backends.redis import Lease
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import SafeTimeConfig, get_config
from celery_safe_time.exceptions import LockConflict
from celery_safe_time.health import check_redis
from celery_safe_time.locks.backends import Owner, get_lock_backend
from celery_safe_time.locks.backends.redis import RedisLockBackend
from celery_safe_time.redis_client import create_redis, is_cluster
from tests.helpers.beat import BEAT_APP, beat_env, duplicates, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def topology_url(request: pytest.FixtureRequest, redis_url: str, name: str) -> str:
    """``safe_time_redis_url`` for topology ``name``: the session's Redis db, the session cluster, a
    Valkey server or a Valkey cluster (each flushed first)."""
    if name == "single":
        return redis_url
    if name == "cluster":
        url: str = request.getfixturevalue("cluster_url")
        return url
    if name == "valkey":
        node = request.getfixturevalue("valkey_node")
        node.client().flushall()
        return f"redis://127.0.0.1:{node.port}/0"
    cluster = request.getfixturevalue("valkey_cluster")
    cluster.flush()
    return str(cluster.url)


@pytest.fixture(params=["single", "cluster"])
def topology(request: pytest.FixtureRequest, redis_url: str) -> str:
    return topology_url(request, redis_url, request.param)


@pytest.fixture
def lease_client(topology: str) -> Iterator[redis.Redis]:
    client = create_redis(topology)
    yield client
    client.close()


@pytest.fixture
def app(make_app: Callable[..., Celery], topology: str) -> Celery:
    return make_app(safe_time_redis_url=topology, safe_time_beat_lease=6)


def _noop(*args: Any) -> None:
    return None


def owner(task_id: str) -> Owner:
    return Owner(task_id=task_id, identity=f"{task_id}:0:0", host="test-host", pid=4242)


def test_the_client_matches_the_url(app: Celery, lease_client: redis.Redis, topology: str) -> None:
    config = get_config(app)
    assert config.redis_cluster == topology.startswith("redis+cluster://")
    assert is_cluster(lease_client) == config.redis_cluster
    lease_client.set(config.key(C.KEY_LOCK, key="probe"), "1")
    assert lease_client.get(config.key(C.KEY_LOCK, key="probe")) == b"1"


def test_lease_acquire_renew_dispatch_release(app: Celery, lease_client: redis.Redis) -> None:
    config = get_config(app)
    a, b = Lease(lease_client, config), Lease(lease_client, config)
    epoch = a.acquire(0.0)
    assert epoch == 1
    assert b.acquire(0.0) is None
    assert a.renew()
    assert not b.renew()
    assert a.dispatch(epoch, "e", 100.0, "{}", 110.0) == 1
    assert a.dispatch(epoch, "e", 100.0, "{}", 110.0) == 0  # slot already fired
    assert b.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1  # not the leader
    marker = config.key(C.KEY_BEAT_FIRED, entry="e", slot=100000)
    assert lease_client.ttl(marker) > 6 * 86400
    writes = [
        SlotWrite("x", '{"last": 100}', 110.0, 100.0),
        SlotWrite("x", "{}", 110.0, 100.0),
        SlotWrite("y", "{}", 5.0),
    ]
    assert a.write_slots(epoch, writes) == [1, 0, 1]
    assert lease_client.zscore(config.key(C.KEY_BEAT_DUE), "y") == 5.0
    # Scripts lost (a restarted or failed-over node): NOSCRIPT is answered by loading them again.
    lease_client.script_flush()
    assert a.write_slots(epoch, [SlotWrite("z", "{}", 320.0, 310.0)]) == [1]
    assert a.release()
    assert b.acquire(0.0) == 2
    assert b.dispatch_slot(2, "e", 100.0) == 0  # fired markers outlive leaders


@pytest.mark.parametrize("key", ["report:1", "sync:{account}", "}odd{", ""])
def test_locks_fences_done_markers(app: Celery, lease_client: redis.Redis, key: str) -> None:
    store = RedisLockBackend(lease_client, get_config(app))
    first = store.acquire(key, "tok-a", 5, owner("a"))
    assert first.status == "acquired"
    held = store.acquire(key, "tok-b", 5, owner("b"))
    assert held.status == "held"
    assert held.holder is not None
    assert held.holder.task_id == "a"
    assert store.acquire(key, "tok-c", 5, owner("a")).status == "duplicate"
    assert store.renew(key, "tok-a", 5)
    assert not store.renew(key, "tok-b", 5)
    assert [i.key for i in store.scan()] == [key]
    assert store.release(key, "tok-a", finished=("a:0:0", 60, "a"))
    assert store.acquire(key, "tok-d", 5, owner("a")).status == "finished"  # a late redelivery
    second = store.acquire(key, "tok-e", 5, owner("e"))
    assert second.status == "acquired"
    assert second.fence is not None
    assert first.fence is not None
    assert second.fence > first.fence
    assert store.token_of(key) == "tok-e"
    assert store.force_release(key) is not None
    assert store.scan() == []


def test_rate_counts_read_every_master(app: Celery, lease_client: redis.Redis) -> None:
    from celery_safe_time.locks.backends import RateCount
    from celery_safe_time.locks.rates import Rate

    store = RedisLockBackend(lease_client, get_config(app))
    keys = ["stripe:1", "stripe:2", "}odd{", "~tilde", ""]
    for key in keys:
        for n in range(3):
            store.rate_take(key, f"t{n}", Rate(2, 30.0))
    assert store.rate_counts() == sorted((RateCount(key, 2, 1) for key in keys), key=lambda c: c.key)
    assert store.rate_counts("stripe:*") == [RateCount("stripe:1", 2, 1), RateCount("stripe:2", 2, 1)]


def test_idempotency_marker_and_commit(app: Celery, lease_client: redis.Redis) -> None:
    store = RedisLockBackend(lease_client, get_config(app))
    lock = C.IDEMPOTENT_LOCK_NAMESPACE + "order:7"
    assert store.acquire(lock, "t1", 5, owner("i"), marker="order:7").status == "acquired"
    assert store.commit(lock, "order:7", "t1", 60, "i", finished=("i:0:0", 60)) == (True, True)
    assert store.commit(lock, "order:7", "t1", 60, "i") == (True, False)  # a retried commit
    assert store.acquire(lock, "t2", 5, owner("j"), marker="order:7").status == "done"


def test_decorated_direct_calls(app: Celery) -> None:
    calls: list[int] = []

    @app.task(shared=False)
    @overlap_lock("busy:{n}", ttl=5)
    def busy(n: int) -> str:
        calls.append(n)
        return "ran"

    @app.task(shared=False)
    @idempotent("charge:{n}", ttl=5)
    def charge(n: int) -> int:
        calls.append(-n)
        return n

    assert busy(1) == "ran"
    get_lock_backend(app).acquire("busy:2", "someone-else", 5, owner("other"))
    with pytest.raises(LockConflict):
        busy(2)
    assert charge(3) == 3
    assert charge(3) is None  # recorded: skipped
    assert calls == [1, -3]


def test_runtime_entries_fire_from_a_leader(app: Celery, tmp_path: Path) -> None:
    app.task(name="t.cluster_noop", shared=False)(_noop)
    save_entry("every-second", "t.cluster_noop", 1.0, app=app)
    save_entry("other", "t.cluster_noop", 3600.0, app=app)
    assert [e.name for e in list_entries(app=app)] == ["every-second", "other"]
    fired: list[str] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        fired.append(kw["entry"])

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        wait_for(lambda: (sched.tick(), fired.count("every-second") >= 2)[1], 15, interval=0.1)
        assert delete_entry("other", app=app) is True
        assert get_entry("other", app=app) is None
        info = get_entry("every-second", app=app)
        assert info is not None
        assert info.last_fired is not None
        # the run history rides in the dispatch script: its keys share the beat hash slot
        assert len(entry_history("every-second", app=app)) >= 2
        assert [c.action for c in entry_audit("other", app=app)] == ["delete", "create"]
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
        sched.close()


def test_check_reads_every_master(app: Celery, lease_client: redis.Redis, topology: str) -> None:
    checks = {c.name: c for c in check_redis(get_config(app), lease_client)}
    assert checks["redis"].status == "ok"
    assert checks["redis_persistence"].status in ("ok", "warn")
    assert "redis_replication" in checks
    if topology.startswith("redis+cluster://"):
        # Every master of the test cluster has a replica and min-replicas-to-write 0.
        assert checks["redis_replication"].status == "warn"
        assert "asynchronous" in checks["redis_replication"].detail


def _leader_pid(client: redis.Redis, config: SafeTimeConfig) -> int | None:
    raw = client.get(config.key(C.KEY_BEAT_LEADER_INFO))
    return int(json.loads(raw)["pid"]) if raw else None


def test_two_beat_processes_one_leader_no_slot_twice(
    processes: ProcessManager, redis_client: redis.Redis, app: Celery, lease_client: redis.Redis, topology: str
) -> None:
    """Real ``celery beat`` processes keep their lease on ``topology``; the leader is killed -9."""
    config = get_config(app)
    schedule = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}
    env = beat_env(schedule, safe_time_beat_lease=4, safe_time_redis_url=topology)
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(2)]
    pid = wait_for(lambda: _leader_pid(lease_client, config), 30, message="a leader")
    wait_for(lambda: len(runs(redis_client)) >= 3, 30, message="runs")
    leader = next(b for b in beats if b.pid == pid)
    leader.kill()
    standby = next(b for b in beats if b is not leader)
    wait_for(lambda: _leader_pid(lease_client, config) == standby.pid, 30, message="the standby takes over")
    count = len(runs(redis_client))
    wait_for(lambda: len(runs(redis_client)) >= count + 3, 30, message="runs from the new leader")
    assert standby.alive()
    standby.terminate()
    time.sleep(2)
    assert duplicates(redis_client) == {}
    epochs = [int(r["headers"]["safe_time_epoch"]) for r in runs(redis_client)]
    assert epochs == sorted(epochs)
    assert len(set(epochs)) == 2


def test_status_probes_metrics_and_locks_list(app: Celery, lease_client: redis.Redis) -> None:
    from celery_safe_time.beat.admin import describe_beat
    from celery_safe_time.cli import probe_beat
    from celery_safe_time.locks.admin import describe_locks, list_locks, release_lock

    config = get_config(app)
    lease = Lease(lease_client, config)
    assert lease.acquire(0.0) == 1
    store = RedisLockBackend(lease_client, config)
    for key in ("job:1", "job:2", "other:{x}", C.IDEMPOTENT_LOCK_NAMESPACE + "pay:9"):
        assert store.acquire(key, "t-" + key, 30, owner(key)).status == "acquired"
    check = probe_beat(app)
    assert check.status == "ok", check.detail
    assert check.value["epoch"] == 1
    assert "error" not in describe_beat(app)
    assert [i.key for i in list_locks(app, "job:*")] == ["job:1", "job:2"]
    assert [i.key for i in list_locks(app)] == ["idem:pay:9", "job:1", "job:2", "other:{x}"]
    assert describe_locks(app)
    released = release_lock(app, "other:{x}")
    assert released is not None
    assert [i.key for i in list_locks(app, "other:*")] == []
    pytest.importorskip("prometheus_client")
    from celery_safe_time.metrics import SafeTimeCollector

    families = {f.name: f for f in SafeTimeCollector(app).collect()}
    assert families["safe_time_overlap_locks_held"].samples[0].value == 3


def test_unique_keys_are_listed_whole_and_a_prefix_is_a_literal_in_scan(
    make_app: Callable[..., Celery], topology: str, lease_client: redis.Redis
) -> None:
    from celery_safe_time.locks.rates import Rate

    store = RedisLockBackend(lease_client, get_config(make_app(safe_time_redis_url=topology)))
    keys = ["order:42", "}odd{", "~tilde", ""]
    for key in keys:
        claim = store.unique_acquire(key, "t-" + key, 30, C.UNIQUE_STATE_QUEUED, stored=False, host="h")
        assert claim.status == "acquired"
    listed = C.UNIQUE_LIST_PREFIX  # ``locks list`` shows unique keys as ``unique:<key>``
    assert [i.key for i in store.scan_unique()] == sorted(listed + key for key in keys)
    assert [i.key for i in store.scan_unique("order:*")] == [listed + "order:42"]
    # A prefix holding glob characters matches only itself, not another app's keys.
    other = RedisLockBackend(
        lease_client, get_config(make_app(safe_time_redis_url=topology, safe_time_key_prefix="gx:"))
    )
    assert other.acquire("job:1", "t", 30, owner("x")).status == "acquired"
    assert other.unique_acquire("job:1", "t", 30, C.UNIQUE_STATE_QUEUED, stored=False, host="h").status == "acquired"
    other.rate_take("job:1", "t", Rate(2, 30.0))
    for prefix in ("g*:", "g?:", "g[x]:"):
        globbed = RedisLockBackend(
            lease_client, get_config(make_app(safe_time_redis_url=topology, safe_time_key_prefix=prefix))
        )
        assert globbed.scan() == []
        assert globbed.scan_unique() == []
        assert globbed.rate_counts() == []
    assert [i.key for i in other.scan()] == ["job:1"]
