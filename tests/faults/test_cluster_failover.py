"""A Redis Cluster master dies (SIGKILL) mid-run and its replica takes over (cluster-node-timeout 1 s):
two beats, a worker and two lock contenders on the cluster. Beat resumes with one leader and fires
no slot twice; a lock held across the failover is still held by its owner on the new master."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.backends.redis import RedisLockBackend
from celery_safe_time.redis_client import create_redis
from tests.helpers.beat import duplicates, runs, settle
from tests.helpers.cluster_run import LockContenders, leader_pid, one_leader_at_a_time, start_beats, wait_runs
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.topologies import LocalCluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("failover-cluster")).start()
    yield cluster
    cluster.stop()


def test_master_failover_mid_run(
    cluster: LocalCluster, processes: ProcessManager, redis_client: redis.Redis, make_app: object
) -> None:
    cluster.flush()
    app: Celery = make_app(safe_time_redis_url=cluster.url)  # type: ignore[operator]
    config = get_config(app)
    client = create_redis(cluster.url)
    store = RedisLockBackend(client, config)
    # A long lock on the beat's master, taken before the fault, and two contenders on another key.
    lease_key = config.key(C.KEY_BEAT_LEASE)
    victim = cluster.master_of(lease_key)
    held_key = next(
        f"held:{i}" for i in range(1000) if cluster.master_of(config.key(C.KEY_LOCK, key=f"held:{i}")) is victim
    )
    owner = Owner(task_id="long", identity="long:0:0", host="test", pid=1)
    long_lock = store.acquire(held_key, "long-token", 120, owner)
    assert long_lock.status == "acquired"
    contended = next(f"c:{i}" for i in range(1000) if cluster.master_of(config.key(C.KEY_LOCK, key=f"c:{i}")) is victim)
    contenders = LockContenders(store, contended).start()
    beats = start_beats(processes, cluster.url)
    wait_for(lambda: leader_pid(client, config), 30, message="a leader")
    wait_runs(redis_client, 5)
    replica = cluster.replica_of(victim)

    killed_at = time.time()
    victim.kill()
    wait_for(lambda: replica.client().info("replication").get("role") == "master", 30, message="replica promoted")
    promoted_at = time.time()
    cluster.wait_ok()
    before = len(runs(redis_client))
    wait_runs(redis_client, before + 5, timeout=90)
    contenders.stop()
    for beat in beats:
        assert beat.alive()
        beat.terminate()
    records = settle(redis_client)

    fresh = create_redis(cluster.url)
    try:
        # The lock taken before the failover replicated: its owner still holds it, fence unchanged.
        other = RedisLockBackend(fresh, config).acquire(held_key, "someone-else", 5, Owner("x", "x:0:0", "test", 2))
        assert other.status == "held"
        assert other.holder is not None
        assert other.holder.fence == long_lock.fence
    finally:
        fresh.close()
    epochs = sorted({int(r["headers"]["safe_time_epoch"]) for r in records})
    print(
        f"failover: promoted {promoted_at - killed_at:.1f} s after the kill; runs {len(records)}; epochs {epochs}; "
        f"lock holds {len(contenders.holds)}, lock errors {contenders.errors}, overlaps {contenders.overlaps()}"
    )
    assert duplicates(redis_client) == {}
    one_leader_at_a_time(records)
    # Loopback replication is immediate: no lock hold lost, so none overlapped (docs: a hold
    # acquired within the replication lag before a crash can be lost, and then overlap).
    assert contenders.overlaps() == []
