"""Operator view of overlap locks: what ``safe-time locks ...`` and ``status`` show."""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery

from .. import constants as C
from ..config import get_config
from .backends import LockInfo, get_lock_backend

__all__ = ["describe_locks", "list_locks", "release_lock"]

#: ``status`` lists at most this many locks (``locks list`` shows them all).
STATUS_LIMIT = 20


def list_locks(app: Celery, pattern: str = "*") -> list[LockInfo]:
    """Held overlap locks (and idempotent in-progress locks, ``idem:...``) matching ``pattern``, then
    held unique task keys (``unique:...``, with their task id and state)."""
    store = get_lock_backend(app)
    found = store.scan(pattern)
    if pattern.startswith(C.UNIQUE_LIST_PREFIX):
        found += store.scan_unique(pattern[len(C.UNIQUE_LIST_PREFIX) :])
    elif pattern == "*":
        found += store.scan_unique("*")
    return found


def release_lock(app: Celery, key: str) -> LockInfo | None:
    """Delete a stuck lock whoever holds it; ``key`` as ``locks list`` shows it (``unique:<key>``
    for a unique task's key, when no overlap lock has that very name)."""
    store = get_lock_backend(app)
    released = store.force_release(store.user_key(key))
    if released is None and key.startswith(C.UNIQUE_LIST_PREFIX):
        released = store.force_release_unique(key[len(C.UNIQUE_LIST_PREFIX) :])
    return released


def store_name(app: Celery) -> str:
    """``Redis`` or ``PostgreSQL``: which backend the app's locks are on (for messages)."""
    return "PostgreSQL" if get_config(app).coordination == C.COORDINATION_POSTGRES else "Redis"


def describe_locks(app: Celery) -> dict[str, Any]:
    """The ``[locks]`` section of ``safe-time status``."""
    try:
        store = get_lock_backend(app)
        locks = store.scan(limit=STATUS_LIMIT + 1)
        unique = store.scan_unique(limit=STATUS_LIMIT + 1)
    except (redis.RedisError, OSError) as exc:
        return {"error": f"{store_name(app)} unreachable: {exc}"}
    shown = locks[:STATUS_LIMIT]
    return {
        "held": len(shown) if len(locks) <= STATUS_LIMIT else f"more than {STATUS_LIMIT}",
        "locks": [
            {"key": i.key, "task_id": i.task_id, "host": i.host, "age": i.age, "ttl_left": i.ttl_left} for i in shown
        ],
        "unique_held": len(unique) if len(unique) <= STATUS_LIMIT else f"more than {STATUS_LIMIT}",
        "unique": [
            {"key": i.key, "task_id": i.task_id, "state": i.state, "age": i.age, "ttl_left": i.ttl_left}
            for i in unique[:STATUS_LIMIT]
        ],
    }
