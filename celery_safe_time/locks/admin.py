"""Operator view of overlap locks: what ``safe-time locks ...`` and ``status`` show."""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery

from .. import constants as C
from ..config import get_config
from .backends import LockInfo, get_lock_backend

__all__ = ["describe_flow", "describe_locks", "list_locks", "release_lock"]

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


def describe_flow(app: Celery) -> dict[str, Any]:
    """The ``[flow]`` section of ``safe-time status``: held ``concurrency_limit`` slots per key, and
    ``rate_limit`` keys with the calls started in their window and the calls waiting for a place
    (delayed by the limit). Bounded: at most ``RATE_SCAN_KEYS`` keys of each are looked at."""
    try:
        store = get_lock_backend(app)
        slots = store.scan(C.SLOT_NAMESPACE + "*#*", limit=C.RATE_SCAN_KEYS)
        rates = store.rate_counts(limit=C.RATE_SCAN_KEYS)
    except (redis.RedisError, OSError) as exc:
        return {"error": f"{store_name(app)} unreachable: {exc}"}
    by_key: dict[str, list[str]] = {}
    for info in slots:
        key, _, slot = info.key.removeprefix(C.SLOT_NAMESPACE).rpartition("#")
        if key and slot.isdigit():
            by_key.setdefault(key, []).append(info.key)
    capped = len(slots) >= C.RATE_SCAN_KEYS or len(rates) >= C.RATE_SCAN_KEYS
    return {
        "slots_held": sum(len(held) for held in by_key.values()),
        "concurrency": [{"key": key, "held": len(held), "slots": held} for key, held in sorted(by_key.items())][
            :STATUS_LIMIT
        ],
        "rate_keys": len(rates),
        "waiting": sum(c.waiting for c in rates),
        "rates": [{"key": c.key, "started": c.started, "waiting": c.waiting} for c in rates[:STATUS_LIMIT]],
        "capped": capped,
    }
