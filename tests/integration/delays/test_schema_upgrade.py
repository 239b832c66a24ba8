"""A table made before the delivery record gets its columns and indexes on first use, and its old rows
get a delivery token when they are claimed."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_safe_time import constants as C
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.backends.sql.schema import delivery_columns
from tests.helpers.delays import fresh_sql_store, new_delay

pytestmark = pytest.mark.integration

URL_FIXTURES = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "mysql": "mysql_url"}


def _downgrade(store: SQLAlchemyStore) -> None:
    """Turn the table back into the pre-delivery-record schema (a table made without the delivery record)."""
    with store.engine.begin() as conn:
        for index in (C.DELAY_SENT_INDEX, C.DELAY_STARTED_INDEX):
            if store.dialect in C.MYSQL_DIALECTS:
                conn.execute(sa.text(f"DROP INDEX {index} ON {C.DELAY_TABLE}"))
            else:
                conn.execute(sa.text(f"DROP INDEX {index}"))
        for column in delivery_columns():
            conn.execute(sa.text(f"ALTER TABLE {C.DELAY_TABLE} DROP COLUMN {column.name}"))


@pytest.mark.parametrize("backend", sorted(URL_FIXTURES))
def test_an_older_table_is_upgraded_and_its_rows_still_run_once(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(URL_FIXTURES[backend])
    old = fresh_sql_store(url)
    old.insert(new_delay("from-before", old.now() - timedelta(seconds=1)))
    _downgrade(old)
    old.close()
    engine = sa.create_engine(old.engine.url)
    columns = {c["name"] for c in sa.inspect(engine).get_columns(C.DELAY_TABLE)}
    engine.dispose()  # its pooled connection, else left to the garbage collector (a ResourceWarning)
    assert "delivery_token" not in columns

    store = SQLAlchemyStore(url)
    store.ensure_schema()
    inspector = sa.inspect(store.engine)
    columns = {c["name"] for c in inspector.get_columns(C.DELAY_TABLE)}
    assert {c.name for c in delivery_columns()} <= columns
    assert {C.DELAY_SENT_INDEX, C.DELAY_STARTED_INDEX} <= {i["name"] for i in inspector.get_indexes(C.DELAY_TABLE)}
    row = store.get("from-before")
    assert row is not None
    assert (row.delivery_token, row.starts) == (None, 0)
    [claimed] = store.claim_due(limit=5, lookahead=0, token="upgrade-claim")
    assert claimed.delivery_token == "upgrade-claim"  # a legacy row gets its token at its claim
    assert store.start("from-before", "upgrade-claim", "run", "host", stale_after=60).verdict == "run"
    assert store.start("from-before", "upgrade-claim", "copy", "host", stale_after=60).verdict == "running"
    store.ensure_schema()  # idempotent
    store.close()


@pytest.mark.parametrize("backend", sorted(URL_FIXTURES))
def test_a_table_without_namespaces_is_upgraded_and_its_rows_are_still_claimed(
    backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(URL_FIXTURES[backend])
    old = fresh_sql_store(url)
    old.insert(new_delay("from-before", old.now() - timedelta(seconds=1)))
    with old.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {C.DELAY_TABLE} DROP COLUMN namespace"))
    old.close()

    store = SQLAlchemyStore(url)
    store.namespace = "proj"  # an app's store after the upgrade (safe_time_store_namespace)
    store.ensure_schema()
    assert "namespace" in {c["name"] for c in sa.inspect(store.engine).get_columns(C.DELAY_TABLE)}
    assert store.get("from-before").namespace == ""  # type: ignore[union-attr]
    assert store.counts()[C.STATUS_PENDING] == 1
    [claimed] = store.claim_due(limit=5, lookahead=0, token="upgrade-claim")
    assert claimed.id == "from-before"
    store.insert(new_delay("after", store.now() + timedelta(hours=1)))
    assert store.get("after").namespace == "proj"  # type: ignore[union-attr]
    store.close()


@pytest.mark.parametrize("backend", sorted(URL_FIXTURES))
def test_upgrade_schema_adds_the_purge_index_to_an_older_table(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(URL_FIXTURES[backend])
    old = fresh_sql_store(url)
    with old.engine.begin() as conn:
        on = f" ON {C.DELAY_TABLE}" if old.dialect in C.MYSQL_DIALECTS else ""
        conn.execute(sa.text(f"DROP INDEX {C.DELAY_UPDATED_INDEX}{on}"))
    old.close()
    store = SQLAlchemyStore(url)
    store.upgrade_schema()
    assert C.DELAY_UPDATED_INDEX in {i["name"] for i in sa.inspect(store.engine).get_indexes(C.DELAY_TABLE)}
    if store.dialect == "postgresql":
        # The purge's delete reads finished rows through it, not the whole table.
        with store.engine.begin() as conn:
            conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
            plan = "\n".join(
                r[0]
                for r in conn.execute(
                    sa.text(
                        f"EXPLAIN SELECT id FROM {C.DELAY_TABLE} WHERE status IN ('expired', 'sent')"
                        " AND updated_at < now() LIMIT 1000"
                    )
                )
            )
        assert C.DELAY_UPDATED_INDEX in plan, plan
    store.close()


@pytest.mark.parametrize("backend", sorted(URL_FIXTURES))
def test_a_table_without_debounce_until_is_upgraded_and_debounces(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(URL_FIXTURES[backend])
    old = fresh_sql_store(url)
    old.insert(new_delay("from-before", old.now() + timedelta(hours=1), idempotency_key="k"))
    with old.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {C.DELAY_TABLE} DROP COLUMN debounce_until"))
    old.close()

    store = SQLAlchemyStore(url)
    store.ensure_schema()
    assert "debounce_until" in {c["name"] for c in sa.inspect(store.engine).get_columns(C.DELAY_TABLE)}
    before = store.get("from-before")
    assert before is not None
    assert (before.debounce_until, before.debounce_key) == (None, None)
    key = C.DEBOUNCE_KEY_PREFIX + "t:k"
    first = dataclasses.replace(new_delay("d1", None, idempotency_key=key), countdown=60.0, debounce_max_wait=120.0)  # type: ignore[arg-type]
    assert store.debounce(first).created
    second = dataclasses.replace(first, id="d2", payload=b"later")
    assert store.debounce(second).task_id == "d1"
    row = store.get("d1")
    assert row is not None
    assert row.payload == b"later"
    assert row.debounce_until is not None
    store.close()
