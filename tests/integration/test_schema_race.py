"""Processes starting together on a PostgreSQL database without the schema: the one that waited for
the schema lock while another made the schema runs no DDL. Run beside the first process's lock calls
or beat writes, that DDL deadlocked with them: a ``CREATE INDEX IF NOT EXISTS`` waits for its table's
SHARE lock even when the index exists (seen in CI: ``DeadlockDetected`` out of a task's first lock call)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_safe_time import constants as C
from celery_safe_time.beat.backends import beat_backend
from celery_safe_time.beat.backends.postgres_reads import DDL as BEAT_DDL
from celery_safe_time.config import get_config
from celery_safe_time.coordination import dispose_engines
from celery_safe_time.locks.backends import postgres_sql
from tests.helpers import services
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A database of this test's own, with no schema in it."""
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    try:
        yield db.url.replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        dispose_engines()
        db.drop()


def _waiting_for_an_advisory_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        query = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        return bool(conn.execute(sa.text(query)).scalar_one())


def _starts_while_another_makes_the_schema(
    engine: sa.Engine,
    lock_key: int,
    make_schema: Callable[[sa.Connection], None],
    busy_table: str,
    start: Callable[[], Any],
) -> Any:
    """``start()`` finds no schema and waits for the schema lock, which a first process holds; the
    schema is made meanwhile and a writer keeps ``busy_table`` (ROW EXCLUSIVE) when the lock frees.
    Returns what ``start()`` returned; fails if it waited for the writer."""
    outcome: list[Any] = []
    with engine.connect() as first:
        first.execute(sa.text("BEGIN"))
        first.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock_key})
        starting = threading.Thread(target=lambda: outcome.append(start()), daemon=True)
        starting.start()
        wait_for(lambda: _waiting_for_an_advisory_lock(engine), 10, message="the start to wait for the schema lock")
        with engine.begin() as maker:
            make_schema(maker)
        with engine.connect() as writer, writer.begin():
            writer.execute(sa.text(f"LOCK TABLE {busy_table} IN ROW EXCLUSIVE MODE"))
            first.execute(sa.text("COMMIT"))
            starting.join(10)
            assert not starting.is_alive(), "the start ran DDL on the schema made while it waited, behind a writer"
    return outcome[0]


def test_a_lock_backend_waiting_for_the_schema_lock_runs_no_ddl_once_another_made_it(empty_database: str) -> None:
    engine = sa.create_engine(empty_database, poolclass=sa.pool.NullPool)
    waiting = sa.create_engine(empty_database, poolclass=sa.pool.NullPool)  # one ensure_schema per engine

    def make_schema(conn: sa.Connection) -> None:
        driver = conn.connection.driver_connection
        assert driver is not None
        for statement in postgres_sql.SCHEMA:
            driver.execute(statement)

    try:
        created = _starts_while_another_makes_the_schema(
            engine,
            postgres_sql.SCHEMA_LOCK_KEY,
            make_schema,
            "safe_time_lock",
            lambda: postgres_sql.ensure_schema(waiting),
        )
        assert created is False
    finally:
        engine.dispose()
        waiting.dispose()


def test_a_beat_waiting_for_the_schema_lock_runs_no_ddl_once_another_made_it(
    make_app: Any, empty_database: str
) -> None:
    engine = sa.create_engine(empty_database, poolclass=sa.pool.NullPool)
    backend = beat_backend(get_config(make_app(safe_time_coordination_url=empty_database)))

    def make_schema(conn: sa.Connection) -> None:
        for statement in BEAT_DDL:
            conn.execute(sa.text(statement))

    try:
        _starts_while_another_makes_the_schema(
            engine, C.BEAT_SCHEMA_LOCK_KEY, make_schema, "safe_time_beat_changes", backend.ensure_tables
        )
    finally:
        engine.dispose()
