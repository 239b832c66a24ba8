"""Delayed-task store backends (SQLAlchemy, Django ORM, memory) behind :func:`get_store`; interface in :mod:`.base`."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from celery import Celery
from celery.signals import worker_init

from ... import constants as C
from ...config import get_config
from ...exceptions import ImproperlyConfigured, StoreError
from .base import DelayStore

__all__ = ["DelayStore", "create_store", "get_store", "set_store"]

logger = logging.getLogger(__name__)

_stores: weakref.WeakKeyDictionary[Celery, tuple[int, DelayStore]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
#: Apps whose store was given with :func:`set_store` rather than made from their settings.
_given: weakref.WeakSet[Celery] = weakref.WeakSet()
#: The entry-point group of stores an add-on installs under a whole ``safe_time_store_url``.
STORE_ENTRY_POINTS = "celery_safe_time.stores"


def create_store(url: str, *, namespace: str | None = None, timeout: float | None = None) -> DelayStore:
    """Build the store named by ``safe_time_store_url``, scoped to ``namespace`` (None: every row).

    ``timeout``: ``safe_time_store_timeout``, the deadline of each call to a SQL store (None: the
    drivers' own, which wait for ever on a hung connection)."""
    store: DelayStore
    if url == C.DJANGO_STORE:
        store = _installed_store(url)
    elif url.startswith("memory:"):
        from .memory import MemoryStore

        store = MemoryStore(url)
    else:
        from .sql import SQLAlchemyStore

        store = SQLAlchemyStore(url, timeout=timeout)
    store.namespace = namespace
    return store


def _installed_store(url: str) -> DelayStore:
    """The store an installed add-on names ``url`` in the :data:`STORE_ENTRY_POINTS` group (the Django
    add-on's ``"django"``): found by name, so this factory never imports the add-on itself."""
    from importlib.metadata import entry_points

    found = entry_points(group=STORE_ENTRY_POINTS, name=url)
    if not found:
        raise ImproperlyConfigured(
            "safe_time_store_url", f"no store {url!r} is installed (entry point group {STORE_ENTRY_POINTS!r})"
        )
    store = next(iter(found)).load()()
    if not isinstance(store, DelayStore):
        raise ImproperlyConfigured("safe_time_store_url", f"the store installed as {url!r} is no DelayStore")
    return store


def get_store(app: Celery) -> DelayStore:
    """The app's store, one per process (rebuilt after ``fork``: connections are not shared)."""
    pid = os.getpid()
    cached = _stores.get(app)
    if cached is not None and cached[0] == pid:
        return cached[1]
    with _lock:
        cached = _stores.get(app)
        if cached is None or cached[0] != pid:
            config = get_config(app)
            store = create_store(config.store_url, namespace=config.store_namespace, timeout=config.store_timeout)
            _stores[app] = (pid, store)
            cached = _stores[app]
    return cached[1]


#: Row states that say a stored task will never run (again).
_ENDED_STATUSES = frozenset({C.STATUS_FINISHED, C.STATUS_CANCELLED, C.STATUS_EXPIRED, C.STATUS_FAILED})


def stored_run_ended(app: Celery, task_id: str) -> bool:
    """Whether ``task_id``'s row in the app's store says it will never run (again): gone, or ended (a
    unique key its task still holds is then a ghost). A store that cannot be read counts it alive."""
    try:
        row = get_store(app).get(task_id)
    except StoreError as exc:
        logger.warning("cannot check unique key holder %s in the store, counting it alive: %s", task_id, exc)
        return False
    return row is None or row.status in _ENDED_STATUSES


def set_store(app: Celery, store: DelayStore) -> None:
    """Make ``store`` the app's store in this process (``celery_safe_time.testing``; tests)."""
    with _lock:
        _stores[app] = (os.getpid(), store)
        _given.add(app)


def close_before_fork(app: Celery) -> None:
    """Close the store ``app``'s process opened (a worker's startup check) before its pool forks, so no
    child inherits a connection. A store given with :func:`set_store` (the testing kit's) is the
    caller's: it stays open."""
    if app not in _given:
        reset_store(app)


def reset_store(app: Celery) -> None:
    """Drop the cached store of ``app`` (tests)."""
    cached = _stores.pop(app, None)
    _given.discard(app)
    if cached is not None and cached[0] == os.getpid():
        cached[1].close()


def _load_store_driver(sender: Any = None, **_: Any) -> None:
    """``worker_init`` (the main process, before the pool forks): import the SQL store's database driver.

    Otherwise each pool child imports it on its first stored task, and the tasks due meanwhile wait
    behind that one (psycopg's import takes a noticeable part of a second, seconds on a loaded host).
    Opens no connection.
    """
    app = getattr(sender, "app", None)
    if not isinstance(app, Celery):
        return
    try:
        url = get_config(app).store_url
        if url == C.DJANGO_STORE or url.startswith("memory:"):
            return
        from .sql import load_driver

        load_driver(url)
    except Exception as exc:  # the store reports a bad URL or a missing driver itself, on first use
        logger.debug("store driver not loaded before the pool forks: %s", exc)


worker_init.connect(_load_store_driver, weak=False, dispatch_uid="celery_safe_time.delays.backends.load_driver")
