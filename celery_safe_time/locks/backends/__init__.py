"""Lock backends: where overlap locks, idempotency markers and unique keys live (see :mod:`.base`).

:func:`get_lock_backend` gives the app's backend (Redis, or PostgreSQL when
``safe_time_coordination_url`` names one), or the one a test put in place (:func:`use_lock_backend`);
:func:`create_lock_backend` builds one from a config. The backend modules are imported only when one is
built: ``import celery_safe_time.locks`` loads neither redis-py's scripts nor SQLAlchemy.
"""

from __future__ import annotations

import os
import threading
import weakref

from celery import Celery

from ... import constants as C
from ...config import SafeTimeConfig, get_config
from ...redis_client import get_redis
from .base import (
    Acquired,
    AcquireStatus,
    Holder,
    HolderRecord,
    LockBackend,
    LockInfo,
    Owner,
    RateCount,
    UniqueClaim,
    UniqueStatus,
)

__all__ = [
    "AcquireStatus",
    "Acquired",
    "Holder",
    "HolderRecord",
    "LockBackend",
    "LockInfo",
    "Owner",
    "RateCount",
    "UniqueClaim",
    "UniqueStatus",
    "create_lock_backend",
    "get_lock_backend",
    "use_lock_backend",
]

_backends: dict[tuple[int, int, SafeTimeConfig], LockBackend] = {}
_backends_lock = threading.Lock()

#: Per app, a lock backend that replaces the configured one (``celery_safe_time.testing``'s in-process one).
_overrides: weakref.WeakKeyDictionary[Celery, LockBackend] = weakref.WeakKeyDictionary()

#: The last answer for each app, by ``id(app)``: (app, pid, its config, backend). A locked task asks for
#: its backend once per call; the full lookup hashes the whole config, which a hit does not.
_recent: dict[int, tuple[weakref.ref[Celery], int, SafeTimeConfig, LockBackend]] = {}


def create_lock_backend(config: SafeTimeConfig) -> LockBackend:
    """A new backend for ``config``: PostgreSQL when ``safe_time_coordination_url`` names one, else Redis
    (on the process's shared client for ``safe_time_redis_url``)."""
    # Not coordination.uses_postgres: importing that module loads SQLAlchemy, which a Redis
    # deployment never needs.
    if config.coordination == C.COORDINATION_POSTGRES:
        from .postgres import postgres_lock_backend

        return postgres_lock_backend(config)
    from .redis import RedisLockBackend

    return RedisLockBackend(get_redis(config.redis_url), config)


def use_lock_backend(app: Celery, backend: LockBackend | None) -> None:
    """Make ``app`` use ``backend`` for its locks (None: back to its configured backend). For tests:
    production never calls it."""
    _recent.clear()
    if backend is None:
        _overrides.pop(app, None)
    else:
        _overrides[app] = backend


def get_lock_backend(app: Celery) -> LockBackend:
    """This process's lock backend for ``app``'s settings (one per process: made again after a fork)."""
    recent = _recent.get(id(app))
    if recent is not None and recent[0]() is app and recent[1] == os.getpid() and recent[2] is get_config(app):
        return recent[3]
    override = _overrides.get(app)
    if override is not None:
        return override
    config = get_config(app)
    if config.coordination == C.COORDINATION_POSTGRES:
        cache_key = (os.getpid(), 0, config)
        backend = _backends.get(cache_key)
        if backend is None:
            with _backends_lock:
                backend = _backends.get(cache_key)
                if backend is None:
                    backend = _backends[cache_key] = create_lock_backend(config)
        return backend
    # Keyed by the client too: a client made again (after a reset) gets a backend of its own.
    client = get_redis(config.redis_url)
    cache_key = (os.getpid(), id(client), config)
    backend = _backends.get(cache_key)
    if backend is None:
        from .redis import RedisLockBackend

        backend = _backends[cache_key] = RedisLockBackend(client, config)
    _recent[id(app)] = (weakref.ref(app), os.getpid(), config, backend)
    return backend
