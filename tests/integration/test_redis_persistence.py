"""What survives a Redis crash (SIGKILL, then a restart on the same dir) under each persistence
setting, and what ``safe-time check`` says about it: the rows of docs/redis.md's table that run here.

- nothing (``save ""``, no AOF): lease, fired markers, locks all gone;
- RDB only: back to the last snapshot: a marker written after it is gone (that slot fires again);
- AOF with ``appendfsync always``: every acknowledged write is back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time.beat.backends.redis import Lease
from celery_safe_time.config import get_config
from celery_safe_time.health import check_redis
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.backends.redis import RedisLockBackend
from tests.helpers import services
from tests.helpers.processes import wait_for
from tests.helpers.topologies import Node

pytestmark = pytest.mark.integration

PERSISTENCE = {
    "none": ["--save", "", "--appendonly", "no"],
    "rdb": ["--save", "3600 1", "--appendonly", "no"],
    "aof": ["--save", "", "--appendonly", "yes", "--appendfsync", "always"],
}


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    started: list[Node] = []

    def start(mode: str) -> Node:
        port = services.free_port()
        args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path / mode), "--daemonize", "no"]
        node = Node(port, tmp_path / mode, [*args, *PERSISTENCE[mode]]).start()
        wait_for(lambda: _ping(node), 10, message=f"redis-server ({mode})")
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


def _ping(node: Node) -> bool:
    try:
        return bool(node.client().ping())
    except redis.RedisError:
        return False


def _crash_and_restart(node: Node) -> redis.Redis:
    node.kill()  # SIGKILL: no shutdown save
    node.start()
    wait_for(lambda: _ping(node), 20, message="restart")
    wait_for(lambda: node.client().info("persistence").get("loading") == 0, 20, message="dataset loaded")
    return node.client()


def _app(make_app: Callable[..., Celery], node: Node) -> Celery:
    return make_app(safe_time_redis_url=f"redis://127.0.0.1:{node.port}/0", safe_time_beat_lease=30)


@pytest.mark.parametrize("mode", ["none", "rdb", "aof"])
def test_what_a_crash_keeps(make_app: Callable[..., Celery], server_factory: Callable[[str], Node], mode: str) -> None:
    node = server_factory(mode)
    app = _app(make_app, node)
    config = get_config(app)
    client = node.client()
    lease = Lease(client, config)
    epoch = lease.acquire(0.0)
    assert epoch == 1
    assert lease.dispatch(epoch, "e", 100.0, "{}", 110.0) == 1
    if mode == "rdb":
        client.save()  # the last snapshot before the crash
    assert lease.dispatch(epoch, "e", 110.0, "{}", 120.0) == 1  # after the snapshot
    store = RedisLockBackend(client, config)
    assert store.acquire("k", "tok", 60, Owner("t", "t:0:0", "h", 1)).status == "acquired"

    after = _crash_and_restart(node)
    first = after.exists(config.key(C.KEY_BEAT_FIRED, entry="e", slot="100000"))
    second = after.exists(config.key(C.KEY_BEAT_FIRED, entry="e", slot="110000"))
    lock = after.exists(config.key(C.KEY_LOCK, key="k"))
    kept = {"none": (0, 0, 0), "rdb": (1, 0, 0), "aof": (1, 1, 1)}[mode]
    assert (first, second, lock) == kept
    if mode == "none":
        # Everything is gone, the epoch counter too: the next leader starts again at epoch 1.
        assert Lease(after, config).acquire(0.0) == 1
        assert Lease(after, config).dispatch_slot(1, "e", 100.0) == -1  # not that leader
    else:
        # The lease came back with the dataset: the old leader still holds it, nobody else may take it.
        assert Lease(after, config).acquire(0.0) is None
        # RDB: the slot marked after the last snapshot is unmarked again: it would fire a second time.
        assert lease.dispatch_slot(epoch, "e", 110.0) == (1 if mode == "rdb" else 0)
        assert lease.dispatch_slot(epoch, "e", 100.0) == 0


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [("none", "warn", "nothing persists"), ("rdb", "warn", "RDB snapshots only"), ("aof", "ok", "appendfsync=always")],
)
def test_check_names_the_persistence_risk(
    make_app: Callable[..., Celery], server_factory: Callable[[str], Node], mode: str, status: str, words: str
) -> None:
    node = server_factory(mode)
    checks = {c.name: c for c in check_redis(get_config(_app(make_app, node)), node.client())}
    assert checks["redis_persistence"].status == status
    assert words in checks["redis_persistence"].detail
    assert checks["redis_replication"].status == "ok"  # no replicas


def test_check_flags_a_replica_without_min_replicas(
    make_app: Callable[..., Celery], server_factory: Callable[[str], Node], tmp_path: Path
) -> None:
    master = server_factory("aof")
    port = services.free_port()
    replica = Node(
        port,
        tmp_path / "replica",
        ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path / "replica"), "--save", "",
         "--replicaof", "127.0.0.1", str(master.port)],
    ).start()  # fmt: skip
    try:
        wait_for(lambda: master.client().info("replication").get("connected_slaves") == 1, 20, message="replica")
        config = get_config(_app(make_app, master))
        checks = {c.name: c for c in check_redis(config, master.client())}
        assert checks["redis_replication"].status == "warn"
        assert "asynchronous" in checks["redis_replication"].detail
        master.client().config_set("min-replicas-to-write", 1)
        checks = {c.name: c for c in check_redis(config, master.client())}
        assert checks["redis_replication"].status == "ok"
    finally:
        replica.stop()
