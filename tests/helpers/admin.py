"""Helpers for the admin tests: hold the beat lease and a lock the way beat and a worker do."""

from __future__ import annotations

import uuid

from celery import Celery

from celery_safe_time.beat.backends import BeatLease, beat_backend
from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner, get_lock_backend

#: An app at module level, for the ``SAFE_TIME_CELERY_APP = "module:attr"`` form of the setting.
DOTTED_APP = Celery("admin-dotted", set_as_current=False)


def hold_lease(app: Celery, *, host: str, pid: int) -> BeatLease:
    """Take the leader lease as beat does, on the app's beat backend (Redis or PostgreSQL), as
    ``host``/``pid`` (it expires after the lease time)."""
    backend = beat_backend(get_config(app))
    lease = backend.make_lease(info={"host": host, "pid": pid})
    assert lease.acquire(backend.clock.time()) is not None, "another beat holds the lease"
    return lease


def hold_lock(app: Celery, key: str, *, task_id: str, host: str, ttl: float = 60.0) -> str:
    """Take overlap lock ``key`` with the worker's script; returns its token."""
    token = uuid.uuid4().hex
    owner = Owner(task_id=task_id, identity=f"{task_id}:1", host=host, pid=123)
    acquired = get_lock_backend(app).acquire(key, token, ttl, owner)
    assert acquired.status == "acquired", acquired
    return token
