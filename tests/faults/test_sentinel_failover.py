"""Sentinel failover for real: a master, a replica and three Sentinels on loopback; the master is
killed (SIGKILL) while two beats, a worker and two lock contenders run on ``sentinel://``.

Measured and printed (docs/redis.md quotes it): how long until the replica is promoted, and what of
the lease, the fired markers, the locks, the idempotency and finished-delivery markers the new master
still has. Replication is asynchronous, so what the old master acknowledged in its last moments may be
missing; on loopback that window is well below a millisecond, so the test asserts nothing was lost of
what was written before the snapshot it takes just before the kill, and that beat resumes with one
leader, fires no slot twice and nothing crashes."""

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
from tests.helpers.topologies import SentinelSetup

pytestmark = pytest.mark.integration


@pytest.fixture
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(tmp_path_factory.mktemp("sentinel")).start()
    yield setup
    setup.stop()


def _keys(client: redis.Redis, pattern: str) -> set[bytes]:
    return set(client.scan_iter(match=pattern, count=1000))


def test_master_killed_beat_resumes_with_one_leader(
    sentinel: SentinelSetup, processes: ProcessManager, redis_client: redis.Redis, make_app: object
) -> None:
    app: Celery = make_app(safe_time_redis_url=sentinel.url)  # type: ignore[operator]
    config = get_config(app)
    client = create_redis(sentinel.url)
    store = RedisLockBackend(client, config)
    long_owner = Owner(task_id="long", identity="long:0:0", host="test", pid=1)
    long_lock = store.acquire("held", "long-token", 120, long_owner)
    assert long_lock.status == "acquired"
    # An idempotent key recorded, and a finished delivery of a locked task.
    lock = C.IDEMPOTENT_LOCK_NAMESPACE + "order:1"
    assert store.acquire(lock, "idem-token", 30, Owner("i", "i:0:0", "test", 2), marker="order:1").status == "acquired"
    assert store.commit(lock, "order:1", "idem-token", 3600, "i", finished=("i:0:0", 3600)) == (True, True)
    contenders = LockContenders(store, "contended").start()
    beats = start_beats(processes, sentinel.url)
    wait_for(lambda: leader_pid(client, config), 30, message="a leader")
    wait_runs(redis_client, 6)

    assert sentinel.master is not None
    assert sentinel.replica is not None
    old_master = sentinel.master.client()
    fired_before = _keys(old_master, config.key_prefix + "beat:fired:*")
    epoch_before = int(old_master.get(config.key(C.KEY_BEAT_EPOCH)) or 0)
    killed_at = time.monotonic()
    sentinel.master.kill()
    replica_port = sentinel.replica.port
    wait_for(lambda: sentinel.current_master_port() == replica_port, 60, message="sentinel promotes the replica")
    promoted_after = time.monotonic() - killed_at
    before = len(runs(redis_client))
    wait_runs(redis_client, before + 5, timeout=90)
    resumed_after = time.monotonic() - killed_at
    contenders.stop()
    for beat in beats:
        assert beat.alive()
        beat.terminate()
    records = settle(redis_client)

    new_master = sentinel.replica.client()
    fired_after = _keys(new_master, config.key_prefix + "beat:fired:*")
    lost_markers = fired_before - fired_after
    lock_after = RedisLockBackend(new_master, config).acquire("held", "other", 5, Owner("x", "x:0:0", "test", 3))
    epochs = sorted({int(r["headers"]["safe_time_epoch"]) for r in records})
    print(
        f"sentinel: promoted {promoted_after:.1f} s after the kill, runs resumed {resumed_after:.1f} s after it; "
        f"fired markers before {len(fired_before)}, lost {len(lost_markers)}; epoch before {epoch_before}, "
        f"epochs seen {epochs}; long lock after: {lock_after.status}; contender holds {len(contenders.holds)}, "
        f"errors {contenders.errors}, overlaps {len(contenders.overlaps())}"
    )
    assert lost_markers == set()
    assert lock_after.status == "held"  # replicated before the kill: still its owner's
    assert lock_after.holder is not None
    assert lock_after.holder.fence == long_lock.fence
    assert new_master.exists(store.marker_key("order:1")) == 1
    assert new_master.exists(store.done_key(lock, "i:0:0")) == 1
    assert duplicates(redis_client) == {}
    one_leader_at_a_time(records)
    assert contenders.overlaps() == []
