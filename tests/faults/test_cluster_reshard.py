"""A slot migration mid-run: the beat slot and a lock's slot move to another master (CLUSTER SETSLOT
IMPORTING/MIGRATING, MIGRATE in small batches, SETSLOT NODE) while two beats, a worker and two lock
contenders run. Beat keeps one leader and fires no slot twice; the lock is never held twice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from redis.cluster import key_slot

from celery_safe_time import constants as C
from celery_safe_time.config import get_config
from celery_safe_time.locks.backends.redis import RedisLockBackend
from celery_safe_time.redis_client import create_redis
from tests.helpers.beat import duplicates, runs, settle
from tests.helpers.cluster_run import (
    LockContenders,
    leader_pid,
    one_leader_at_a_time,
    start_beats,
    wait_runs,
)
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.topologies import LocalCluster, Node

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("reshard-cluster")).start()
    yield cluster
    cluster.stop()


def _node_id(node: Node) -> str:
    raw = node.client().cluster("myid")
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def migrate_slot(cluster: LocalCluster, slot: int, source: Node, target: Node, batch: int = 3) -> int:
    """Move ``slot`` from ``source`` to ``target`` the way ``redis-cli --cluster reshard`` does, in
    small batches with pauses so the run sees the slot half moved (ASK redirects, TRYAGAIN)."""
    src, dst = source.client(), target.client()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(source))
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(target))
    moved = 0
    while True:
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
        if not keys:
            break
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "REPLACE", "KEYS", *keys)
        moved += len(keys)
        time.sleep(0.1)
    for node in cluster.nodes:
        if node.alive() and node.client().info("replication").get("role") == "master":
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(target))
    return moved


def test_slot_migration_mid_run(
    cluster: LocalCluster,
    processes: ProcessManager,
    redis_client: redis.Redis,
    make_app: object,
    tmp_path: Path,
) -> None:
    cluster.flush()
    app: Celery = make_app(safe_time_redis_url=cluster.url)  # type: ignore[operator]
    config = get_config(app)
    client = create_redis(cluster.url)
    contenders = LockContenders(RedisLockBackend(client, config), "reshard:k").start()
    beats = start_beats(processes, cluster.url)
    wait_for(lambda: leader_pid(client, config), 30, message="a leader")
    wait_runs(redis_client, 5)

    beat_slot = int(key_slot(config.key(C.KEY_BEAT_LEASE).encode()))
    lock_slot = int(key_slot(config.key(C.KEY_LOCK, key="reshard:k").encode()))
    moved = 0
    for slot, key in ((beat_slot, config.key(C.KEY_BEAT_LEASE)), (lock_slot, config.key(C.KEY_LOCK, key="reshard:k"))):
        source = cluster.master_of(key)
        target = next(n for n in cluster.nodes[:3] if n is not source and n.alive())
        before = len(runs(redis_client))
        moved += migrate_slot(cluster, slot, source, target)
        assert cluster.master_of(key).port == target.port
        wait_runs(redis_client, before + 3)
    cluster.wait_ok()
    after = len(runs(redis_client))
    wait_runs(redis_client, after + 3)
    contenders.stop()
    for beat in beats:
        assert beat.alive()
        beat.terminate()
    records = settle(redis_client)
    epochs = sorted({int(r["headers"]["safe_time_epoch"]) for r in records})
    errors = sum(b.log().count("Redis error") for b in beats)
    print(
        f"reshard: moved {moved} keys; lock holds {len(contenders.holds)}, lock errors {contenders.errors}; "
        f"runs {len(records)}; epochs {epochs}; beat Redis errors {errors}"
    )
    assert moved > 5  # fired markers, lease, state... really moved
    assert duplicates(redis_client) == {}
    one_leader_at_a_time(records)
    assert contenders.overlaps() == []
    assert len(contenders.holds) > 5
