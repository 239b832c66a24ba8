"""The unique-key scripts (``unique_acquire.lua``, ``unique_release.lua``) on a real Redis, and the
PostgreSQL backend's ``safe_time_unique`` rows and the testing plugin's ``MemoryLockBackend`` following
the same rules, call for call."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import LockBackend
from celery_safe_time.locks.backends.redis import RedisLockBackend
from celery_safe_time.testing import MemoryLockBackend

pytestmark = pytest.mark.integration


@pytest.fixture
def store(lock_backend: LockBackend) -> LockBackend:
    return lock_backend


def test_acquire_conflict_own_refresh_gone_replace_and_release(store: LockBackend) -> None:
    take = store.unique_acquire
    assert take("k", "t1", 60, "queued", stored=False, host="h1").status == "acquired"

    held = take("k", "t2", 60, "queued", stored=False, host="h2")
    assert (held.status, held.holder, held.state, held.stored) == ("held", "t1", "queued", False)
    assert held.ttl_left is not None
    assert 50 < held.ttl_left <= 60
    # the same id from outside the run is a conflict too: a caller reusing a task id gets the holder
    assert take("k", "t1", 60, "queued", stored=False, host="h2").status == "held"
    # the run itself (own): refreshed, stored flag kept when None
    assert take("k", "t1", 120, "running", stored=None, host="w1", own=True).status == "own"
    info = store.unique_info("k", _now(store))
    assert info is not None
    assert (info.task_id, info.state, info.host, info.kind) == ("t1", "running", "w1", "unique")
    assert info.ttl_left is not None
    assert info.ttl_left > 100
    # a "gone" holder that is not the holder any more changes nothing
    assert take("k", "t3", 60, "stored", stored=True, host="h3", gone="t0").status == "held"
    # the holder the caller found gone: replaced
    assert take("k", "t3", 60, "stored", stored=True, host="h3", gone="t1").status == "acquired"
    replaced = take("k", "t4", 60, "queued", stored=False, host="h4")
    assert (replaced.holder, replaced.state, replaced.stored) == ("t3", "stored", True)

    assert not store.unique_release("k", "t1")  # the old holder never frees the new one's key
    assert store.unique_release("k", "t3")
    assert store.unique_info("k", _now(store)) is None
    assert take("k", "t4", 60, "queued", stored=False, host="h4").status == "acquired"
    assert [i.key for i in store.scan_unique()] == ["unique:k"]
    released = store.force_release_unique("k")
    assert released is not None
    assert released.task_id == "t4"
    assert store.scan_unique() == []


def test_own_on_a_free_key_takes_it(store: LockBackend) -> None:
    # a redelivered run whose key expired meanwhile takes it again rather than run unguarded
    assert store.unique_acquire("k2", "t1", 60, "running", stored=None, host="w", own=True).status == "acquired"
    info = store.unique_info("k2", _now(store))
    assert info is not None
    assert info.state == "running"


def test_the_redis_key_is_one_hash_in_its_own_family(
    redis_client: redis.Redis, make_app: Callable[..., Celery]
) -> None:
    store = RedisLockBackend(redis_client, get_config(make_app()))
    store.unique_acquire("export:{7}", "t1", 60, "queued", stored=False, host="h")
    assert redis_client.keys("*") == [b"safe_time:unique:export:{7}"]
    fields = {k.decode() for k in redis_client.hgetall("safe_time:unique:export:{7}")}
    assert fields == {"task_id", "state", "stored", "host", "created_at", "updated_at", "ttl_ms"}


def _now(store: LockBackend) -> float:
    if isinstance(store, MemoryLockBackend):
        return float(store._clock())
    if not isinstance(store, RedisLockBackend):
        return time.time()  # PostgreSQL reads its own clock
    seconds, micros = store.client.time()
    return float(seconds) + float(micros) / 1e6
