"""Which lock backend an app uses: :func:`get_lock_store` (Redis, or PostgreSQL when
``safe_time_coordination_url`` names one), or the one a test put in place (:func:`use_lock_store`).

The interface and its result types are in :mod:`.backends.base`; this module re-exports them, and
``LockStore`` stays the name of the Redis backend (``LockStore(redis_client, config)``).
"""

from __future__ import annotations

import os
import threading
import weakref

from celery import Celery

from .. import constants as C
from ..config import SafeTimeConfig, get_config
from ..redis_client import get_redis
from .backends.base import (
    Acquired,
    AcquireStatus,
    Holder,
    HolderRecord,
    LockBackend,
    LockInfo,
    Owner,
    UniqueClaim,
    UniqueStatus,
)
from .backends.redis import SCRIPTS, RedisLockStore

#: The Redis backend under its first name (tests and tools build it from a client and a config).
LockStore = RedisLockStore

__all__ = [
    "SCRIPTS",
    "AcquireStatus",
    "Acquired",
    "Holder",
    "HolderRecord",
    "LockBackend",
    "LockInfo",
    "LockStore",
    "Owner",
    "RedisLockStore",
    "UniqueClaim",
    "UniqueStatus",
    "get_lock_store",
    "use_lock_store",
]

_stores: dict[tuple[int, int, SafeTimeConfig], LockBackend] = {}
_stores_lock = threading.Lock()

#: Per app, a lock store that replaces the configured one (``celery_safe_time.testing``'s in-process one).
_overrides: weakref.WeakKeyDictionary[Celery, LockBackend] = weakref.WeakKeyDictionary()


#: The last answer for each app, by ``id(app)``: (app, pid, its config, store). A locked task asks for
#: its store once per call; the full lookup hashes the whole config, which a hit does not.
_recent: dict[int, tuple[weakref.ref[Celery], int, SafeTimeConfig, LockBackend]] = {}


def use_lock_store(app: Celery, store: LockBackend | None) -> None:
    """Make ``app`` use ``store`` for its locks (None: back to its configured backend). For tests:
    production never calls it."""
    _recent.clear()
    if store is None:
        _overrides.pop(app, None)
    else:
        _overrides[app] = store


def get_lock_store(app: Celery) -> LockBackend:
    """This process's lock backend for ``app``'s settings (one per process: made again after a fork)."""
    recent = _recent.get(id(app))
    if recent is not None and recent[0]() is app and recent[1] == os.getpid() and recent[2] is get_config(app):
        return recent[3]
    override = _overrides.get(app)
    if override is not None:
        return override
    config = get_config(app)
    # Not coordination.uses_postgres: importing that module loads SQLAlchemy, which a Redis
    # deployment never needs (``import celery_safe_time.locks`` stays light).
    if config.coordination == C.COORDINATION_POSTGRES:
        cache_key = (os.getpid(), 0, config)
        store = _stores.get(cache_key)
        if store is None:
            from .backends.postgres import postgres_lock_store

            with _stores_lock:
                store = _stores.get(cache_key)
                if store is None:
                    store = _stores[cache_key] = postgres_lock_store(config)
        return store
    client = get_redis(config.redis_url)
    cache_key = (os.getpid(), id(client), config)
    store = _stores.get(cache_key)
    if store is None:
        store = _stores[cache_key] = RedisLockStore(client, config)
    _recent[id(app)] = (weakref.ref(app), os.getpid(), config, store)
    return store
