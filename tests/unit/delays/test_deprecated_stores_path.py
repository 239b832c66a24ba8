"""The pre-0.9 import path ``celery_safe_time.delays.stores`` warns and still hands out the same objects."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_the_old_stores_path_warns_and_still_exports_the_store_and_the_factory() -> None:
    for name in [m for m in sys.modules if m.startswith("celery_safe_time.delays.stores")]:
        del sys.modules[name]
    with pytest.warns(DeprecationWarning, match=r"celery_safe_time\.delays\.backends"):
        stores = importlib.import_module("celery_safe_time.delays.stores")
    sql = importlib.import_module("celery_safe_time.delays.stores.sql")
    base = importlib.import_module("celery_safe_time.delays.stores.base")
    memory = importlib.import_module("celery_safe_time.delays.stores.memory")

    from celery_safe_time.delays import backends
    from celery_safe_time.delays.backends.base import DelayStore, NewDelay
    from celery_safe_time.delays.backends.memory import MemoryStore
    from celery_safe_time.delays.backends.sql import SQLAlchemyStore

    assert stores.get_store is backends.get_store
    assert stores.reset_store is backends.reset_store
    assert sql.SQLAlchemyStore is SQLAlchemyStore
    assert base.DelayStore is DelayStore
    assert base.NewDelay is NewDelay
    assert memory.MemoryStore is MemoryStore


def test_the_sql_store_reads_its_named_queries_from_the_package_resources() -> None:
    from celery_safe_time.delays.backends.sql import query

    assert query("now_postgresql") == "SELECT clock_timestamp()"
    assert query("lock_schema_postgresql") == "SELECT pg_advisory_xact_lock(:key)"
    assert query("pending_key_mysql", "schema.sql") == "CASE WHEN status = 'pending' THEN idempotency_key END"
