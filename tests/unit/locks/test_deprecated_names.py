"""The lock seam's pre-0.9 names (``locks.store``, ``*LockStore``, ``get_lock_store``) warn and still
hand out the same objects as ``locks.backends``."""

from __future__ import annotations

import importlib
import sys

import pytest

from celery_safe_time.locks import backends
from celery_safe_time.locks.backends import memory, postgres, redis
from celery_safe_time.locks.backends.base import LockBackend, Owner


def test_the_old_store_module_warns_and_still_exports_the_factory_and_the_redis_backend() -> None:
    sys.modules.pop("celery_safe_time.locks.store", None)
    with pytest.warns(DeprecationWarning, match=r"celery_safe_time\.locks\.backends"):
        store = importlib.import_module("celery_safe_time.locks.store")
    assert store.get_lock_store is backends.get_lock_backend
    assert store.use_lock_store is backends.use_lock_backend
    assert store.LockStore is store.RedisLockStore is redis.RedisLockBackend
    assert store.LockBackend is LockBackend
    assert store.Owner is Owner
    assert store.SCRIPTS == redis.SCRIPTS


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        (memory, "MemoryLockStore", "MemoryLockBackend"),
        (redis, "RedisLockStore", "RedisLockBackend"),
        (postgres, "PostgresLockStore", "PostgresLockBackend"),
        (postgres, "PostgresSessionLockStore", "PostgresSessionLockBackend"),
        (postgres, "postgres_lock_store", "postgres_lock_backend"),
    ],
)
def test_an_old_backend_name_warns_and_is_the_new_one(module: object, old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated; use {new}"):
        value = getattr(module, old)
    assert value is getattr(module, new)


def test_the_testing_plugin_still_hands_out_memory_lock_store_with_a_warning() -> None:
    import celery_safe_time.testing as testing

    with pytest.warns(DeprecationWarning, match="MemoryLockBackend"):
        from celery_safe_time.testing import MemoryLockStore  # type: ignore[attr-defined]
    assert MemoryLockStore is testing.MemoryLockBackend is memory.MemoryLockBackend


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        memory.Nope  # type: ignore[attr-defined]  # noqa: B018


def test_on_redis_error_is_a_deprecated_name_of_on_backend_error() -> None:
    from celery_safe_time import idempotent, overlap_lock

    with pytest.warns(DeprecationWarning, match=r"overlap_lock\(on_redis_error=\.\.\.\) is deprecated"):
        lock = overlap_lock("k:{n}", on_redis_error="raise")
    with pytest.warns(DeprecationWarning, match=r"idempotent\(on_redis_error=\.\.\.\) is deprecated"):
        once = idempotent("k:{n}", on_redis_error="raise")

    def body(n: int) -> int:
        return n

    for decorate in (lock, once):
        (task_lock,) = decorate(body).__safe_time_locks__  # type: ignore[attr-defined]
        assert task_lock.policy.on_backend_error == "raise"
    (default,) = overlap_lock("k:{n}")(body).__safe_time_locks__  # type: ignore[attr-defined]
    assert default.policy.on_backend_error == "retry"
    with (
        pytest.warns(DeprecationWarning, match="on_redis_error"),
        pytest.raises(ValueError, match="on_backend_error must be one of"),
    ):
        overlap_lock("k:{n}", on_redis_error="ignore")  # type: ignore[arg-type]


def test_a_redis_outage_is_still_caught_as_redis_unavailable_and_any_backend_outage_as_coordination_unavailable() -> (
    None
):
    from celery_safe_time.exceptions import CoordinationUnavailable, RedisUnavailable, SafeTimeError

    assert issubclass(RedisUnavailable, CoordinationUnavailable)
    assert issubclass(CoordinationUnavailable, SafeTimeError)
    assert issubclass(CoordinationUnavailable, ConnectionError)
    assert redis.RedisLockBackend.unavailable is RedisUnavailable
    assert postgres.PostgresLockBackend.unavailable is CoordinationUnavailable
    assert (redis.RedisLockBackend.label, postgres.PostgresLockBackend.label) == ("Redis", "PostgreSQL")
