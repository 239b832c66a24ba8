"""What the SQLAlchemy store does differently on MariaDB/MySQL: its DDL (no partial indexes,
``DATETIME(6)``, a binary collation), its clock and concurrent SKIP LOCKED claims.

The common behaviour is the contract suite's ``mysql`` case (tests/contract).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_safe_time import constants as C
from celery_safe_time.delays.backends.sql import SQLAlchemyStore, create_engine, metadata
from celery_safe_time.delays.backends.sql.schema import MARIADB_COLLATION, MYSQL_COLLATION
from celery_safe_time.exceptions import StoreError
from tests.helpers.delays import fresh_sql_store, new_delay

pytestmark = pytest.mark.integration


@pytest.fixture
def store(mysql_url: str) -> Iterator[SQLAlchemyStore]:
    store = fresh_sql_store(mysql_url)
    yield store
    store.close()


def _columns(store: SQLAlchemyStore) -> dict[str, dict[str, str]]:
    query = sa.text(
        "SELECT column_name AS name, column_type AS type, extra, collation_name AS collation"
        " FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = :table"
    )
    with store.engine.connect() as conn:
        return {row.name: dict(row._mapping) for row in conn.execute(query, {"table": C.DELAY_TABLE})}


def _indexes(store: SQLAlchemyStore) -> dict[str, tuple[bool, list[str]]]:
    found: dict[str, tuple[bool, list[str]]] = {}
    for index in sa.inspect(store.engine).get_indexes(C.DELAY_TABLE):
        found[str(index["name"])] = (bool(index["unique"]), [str(c) for c in index["column_names"]])
    return found


def test_schema_has_microsecond_datetimes_a_pending_key_column_and_status_led_indexes(
    store: SQLAlchemyStore,
) -> None:
    columns = _columns(store)
    for name in ("due_at", "expires_at", "created_at", "updated_at", "claimed_at", "sent_at"):
        assert columns[name]["type"] == "datetime(6)", name
    assert columns["payload"]["type"] == "longblob"
    pending_key = columns[C.DELAY_PENDING_KEY_COLUMN]
    assert "GENERATED" in pending_key["extra"].upper() or "PERSISTENT" in pending_key["extra"].upper()
    mariadb = bool(getattr(store.engine.dialect, "is_mariadb", False))
    assert columns["id"]["collation"] == (MARIADB_COLLATION if mariadb else MYSQL_COLLATION)
    assert _indexes(store) == {
        C.DELAY_DUE_INDEX: (False, ["status", "due_at", "id"]),
        C.DELAY_KEY_INDEX: (True, [C.DELAY_PENDING_KEY_COLUMN]),
        C.DELAY_CLAIMED_INDEX: (False, ["status", "claimed_at"]),
        C.DELAY_SENT_INDEX: (False, ["status", "sent_at"]),
        C.DELAY_STARTED_INDEX: (False, ["status", "heartbeat_at"]),
        C.DELAY_UPDATED_INDEX: (False, ["status", "updated_at"]),
    }


def test_ids_and_keys_compare_exactly_as_on_postgresql(store: SQLAlchemyStore) -> None:
    due = store.now() + timedelta(hours=1)
    for task_id, key in (("a", "k"), ("A", "K"), ("a ", "k ")):
        assert store.insert(new_delay(task_id, due, idempotency_key=key)).created, (task_id, key)
    assert not store.insert(new_delay("b", due, idempotency_key="K")).created
    assert store.counts()[C.STATUS_PENDING] == 3


def test_clock_and_stored_times_ignore_the_session_time_zone(mysql_url: str) -> None:
    fresh_sql_store(mysql_url).close()
    engine = create_engine(mysql_url, connect_args={"init_command": "SET time_zone = '+05:00'", "connect_timeout": 5})
    store = SQLAlchemyStore(mysql_url, engine=engine)
    try:
        now = store.now()
        assert abs(now.timestamp() - time.time()) < 5
        store.insert(new_delay("tz-due", now - timedelta(seconds=1)))
        store.insert(new_delay("tz-later", now + timedelta(hours=1)))
        row = store.get("tz-later")
        assert row is not None
        assert row.due_at == now + timedelta(hours=1)
        assert abs(row.created_at.timestamp() - time.time()) < 5
        assert [r.id for r in store.claim_due(limit=10, lookahead=0, token="tz")] == ["tz-due"]
    finally:
        store.close()


def test_urls_without_a_driver_use_pymysql(store: SQLAlchemyStore, mysql_url: str) -> None:
    for scheme in ("mysql", "mariadb"):
        other = SQLAlchemyStore(scheme + "://" + mysql_url.split("://", 1)[1])
        try:
            assert other.engine.dialect.driver == "pymysql"
            assert other.dialect == scheme
            now = other.now()
            other.insert(new_delay(f"{scheme}-row", now - timedelta(microseconds=1)))
            [row] = other.claim_due(limit=10, lookahead=0, token=scheme)
            assert row.due_at == now - timedelta(microseconds=1)
        finally:
            other.close()


def test_a_table_without_the_pending_key_column_is_refused(store: SQLAlchemyStore, mysql_url: str) -> None:
    store.drop_schema()
    # The PostgreSQL/SQLite DDL on MySQL, as Django's migration creates it.
    metadata.create_all(store.engine)
    try:
        with pytest.raises(StoreError, match=C.DELAY_PENDING_KEY_COLUMN):
            SQLAlchemyStore(mysql_url).ensure_schema()
    finally:
        store.drop_schema()
    fresh_sql_store(mysql_url).close()


def test_four_threads_claim_2000_due_rows_exactly_once(store: SQLAlchemyStore, mysql_url: str) -> None:
    rows = 2000
    store.bulk_insert([new_delay(f"m{i:05d}", store.now() - timedelta(seconds=1)) for i in range(rows)])
    claimed: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def sweeper(name: str) -> None:
        # Each thread has its own engine and pool, like a separate sweeper process.
        own = SQLAlchemyStore(mysql_url)
        mine: list[str] = []
        try:
            start.wait(30)
            while batch := own.claim_due(limit=50, lookahead=0, token=name):
                mine.extend(r.id for r in batch)
                assert own.mark_sent([r.id for r in batch], name) == len(batch)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            claimed[name] = mine
            own.close()

    threads = [threading.Thread(target=sweeper, args=(f"w{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    everything = [task_id for ids in claimed.values() for task_id in ids]
    assert len(everything) == rows
    assert len(set(everything)) == rows
    assert sum(1 for ids in claimed.values() if ids) >= 2, {k: len(v) for k, v in claimed.items()}
    assert store.counts()[C.STATUS_SENT] == rows
