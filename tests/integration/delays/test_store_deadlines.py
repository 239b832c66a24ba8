"""Every call of a SQL store has a deadline (``safe_time_store_timeout``): a statement that waits on a
stuck server (here: a row another transaction keeps locked) ends in ``StoreError`` instead of never
returning, on PostgreSQL and on MariaDB/MySQL."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays.backends import get_store, reset_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore, create_engine
from celery_safe_time.exceptions import StoreError
from celery_safe_time.sql.engine import STORE_KEEPALIVE_COUNT
from tests.helpers.delays import fresh_sql_store, new_delay, utcnow

pytestmark = pytest.mark.integration

TIMEOUT = 1.0


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_store_call_stuck_behind_a_locked_row_fails_within_the_store_timeout(
    server: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("postgres_url" if server == "postgresql" else "mysql_url")
    fresh_sql_store(url).close()
    store = SQLAlchemyStore(url, timeout=TIMEOUT)
    store.insert(new_delay("stuck", utcnow()))
    [row] = store.claim_due(limit=1, lookahead=0, token="claim")
    assert row.delivery_token is not None
    assert store.start("stuck", row.delivery_token, "run-1", "w", stale_after=60).verdict == "run"
    holder_engine = create_engine(url)
    holder = holder_engine.connect()
    transaction = holder.begin()
    holder.execute(sa.text(f"SELECT id FROM {C.DELAY_TABLE} WHERE id = 'stuck' FOR UPDATE"))
    try:
        began = time.monotonic()
        with pytest.raises(StoreError):
            store.heartbeat("stuck", row.delivery_token, "run-1")
        # Once on the pooled connection, once more on a new one (a broken connection is retried).
        assert time.monotonic() - began < 2 * TIMEOUT + 3.0
    finally:
        transaction.rollback()
        holder.close()
        holder_engine.dispose()  # its pool's connection, else left to the garbage collector (a ResourceWarning)
    assert store.heartbeat("stuck", row.delivery_token, "run-1")
    store.close()


def test_the_store_of_an_app_gets_safe_time_store_timeout_on_every_connection(postgres_url: str) -> None:
    app = Celery("deadlines", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        safe_time_redis_url="redis://127.0.0.1:1/0",
        safe_time_store_url=postgres_url,
        safe_time_store_timeout=7,
    )
    install(app)
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    try:
        engines = [store.engine]
        if store._record_writes is not None:
            engines += list(store._record_writes.engines.values())
        for engine in engines:
            with engine.connect() as conn:
                assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "7s"
                # The client's side of the socket (libpq's parameters, not the server's settings).
                params = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
                assert params["tcp_user_timeout"] == "7000"
                assert (params["keepalives"], params["keepalives_count"]) == ("1", str(STORE_KEEPALIVE_COUNT))
    finally:
        reset_store(app)
        app.close()
