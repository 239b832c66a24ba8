"""Connections that hang (a stalled network path: writes succeed, no reply comes, nothing closes).

- A worker whose store connections hang while the sweep still reaches the database: its acks_late
  stored run gives the row up within ``safe_time_lock_ttl`` (``LockLost`` in the body) before the
  sweep may start it again, so the two runs are never at once.
- A statement on a store or coordination connection that hangs ends at the client's answer deadline.
- A sweep whose broker (Redis) connection hangs mid-publish returns within its publish deadline and
  the rows are published by a later sweep.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.config import get_config
from celery_safe_time.coordination import coordination_engine
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.publish import publish_wait
from celery_safe_time.delays.sweep import sweep
from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers.delays import finished_row, fresh_sql_store, new_delay, runs, utcnow
from tests.helpers.processes import ProcessManager, wait_for
from tests.integration.delays.test_delivery import Setup, ends

pytestmark = pytest.mark.integration

LOCK_TTL = 3.0
BODY_SECONDS = 20.0


@pytest.fixture
def stalled_store(postgres_url: str) -> Iterator[tuple[str, TcpProxy]]:
    store = fresh_sql_store(postgres_url)
    proxy, url = proxy_for(postgres_url)
    yield url, proxy
    proxy.close()
    store.close()


def test_a_stored_run_whose_store_connection_hangs_stops_before_the_sweep_runs_it_again(
    make_app: Callable[..., Celery],
    redis_url: str,
    postgres_url: str,
    stalled_store: tuple[str, TcpProxy],
    processes: ProcessManager,
    redis_client: redis.Redis,
) -> None:
    proxied_url, proxy = stalled_store
    # prefetch 1: a worker busy with the acks_late run fetches nothing more, so the run the sweep
    # starts again goes to the other worker while the first may still be running.
    setup = Setup(
        make_app, redis_url, redis_url, postgres_url, safe_time_lock_ttl=LOCK_TTL, worker_prefetch_multiplier=1
    )
    stalled_conf: dict[str, Any] = {**setup.conf, "safe_time_store_url": proxied_url}
    stalled = setup.worker(processes, "stalled", SAFE_TIME_TEST_APP_CONF=json.dumps(stalled_conf))
    result = setup.tasks["slow_steps"].apply_async(("hung",), {"seconds": BODY_SECONDS}, countdown=1.5)
    setup.sweep_until(lambda: len(runs(redis_client)) >= 1, 30, "the first run to start")
    store = get_store(setup.app)

    def heartbeat_written() -> bool:
        row = store.get(result.id)
        return bool(row and row.heartbeat_at and row.started_at and row.heartbeat_at > row.started_at)

    # A heartbeat went through: its connection is open and pooled, so the next one hangs on it.
    wait_for(heartbeat_written, 10, interval=0.1, message="a heartbeat of the first run")
    assert proxy.stall(new=True) >= 2  # every store connection of that worker hangs, new ones too
    stalled_at = time.monotonic()
    setup.worker(processes, "rescuer")
    resumed = False

    def second_run_ended() -> bool:
        nonlocal resumed
        if not resumed and time.monotonic() - stalled_at > 5 * LOCK_TTL:
            # The network path comes back: a run the stalled worker took meanwhile can go on.
            proxy.resume()
            resumed = True
        sweep(setup.app)
        return any("error" not in end for end in ends(redis_client))

    wait_for(second_run_ended, 90, interval=0.3, message="the run started again to finish")
    starts = sorted(r["started"] for r in runs(redis_client))
    finished = sorted(end["ended"] for end in ends(redis_client))
    assert len(starts) == 2, runs(redis_client)
    # Never two at once: the second run started after the first one ended.
    assert starts[1] >= finished[0], (starts, finished)
    first_end = min(ends(redis_client), key=lambda end: end["ended"])
    assert "LockLost" in first_end.get("error", ""), first_end
    assert first_end["ended"] - starts[0] < BODY_SECONDS / 2
    stalled.wait_for_log(r"lost its delivery record: no heartbeat written for", timeout=5)
    row = finished_row(store, result.id)
    assert (row.status, row.outcome) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED)


def test_a_sweep_whose_broker_connection_hangs_returns_within_its_publish_deadline(
    make_app: Callable[..., Celery], redis_url: str, postgres_url: str
) -> None:
    store = fresh_sql_store(postgres_url)
    proxy, broker_url = proxy_for(redis_url)  # the broker's Redis, through the proxy
    app = make_app(
        "stalled-broker",
        broker_url=broker_url,
        safe_time_redis_url=redis_url,
        safe_time_store_url=postgres_url,
        safe_time_delay_threshold=1,
        safe_time_claim_timeout=4,
    )
    install(app)
    assert publish_wait(get_config(app)) == 1.0
    for n in range(3):
        store.insert(new_delay(f"row-{n}", utcnow()))
    proxy.stall(new=True)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["stats"] = sweep(app)
        except Exception as exc:
            outcome["error"] = exc

    began = time.monotonic()
    sweeper = threading.Thread(target=run, daemon=True)
    sweeper.start()
    sweeper.join(30)
    took = time.monotonic() - began
    proxy.resume()
    assert not sweeper.is_alive(), "the sweep is still waiting for the broker"
    assert "error" in outcome, outcome
    assert took < 20, took
    # Nothing lost: the rows went back to be published (at once, or after the claim timeout).
    rows = [store.get(f"row-{n}") for n in range(3)]
    assert all(row is not None and row.status in (C.STATUS_PENDING, C.STATUS_CLAIMED) for row in rows), rows
    proxy.close()
    store.close()


@pytest.mark.parametrize("engine_of", ["store", "coordination"])
def test_a_statement_on_a_connection_that_hangs_ends_at_the_clients_deadline(
    make_app: Callable[..., Celery], postgres_url: str, engine_of: str
) -> None:
    """A peer that takes every byte and never answers (a hung PgBouncer or proxy): no server-side or
    kernel timeout ends the wait, the client's answer deadline does (store: ``safe_time_store_timeout``
    plus 2 s; coordination: ``safe_time_coordination_io_timeout``). The connection is dropped, and the
    next call gets a new one."""
    proxy, url = proxy_for(postgres_url)
    if engine_of == "store":
        store = SQLAlchemyStore(url, timeout=1.0)
        engine, deadline = store.engine, 3.0
    else:
        app = make_app("stalled-coordination", safe_time_coordination_url=url, safe_time_coordination_io_timeout=2)
        engine, deadline = coordination_engine(get_config(app)), 2.0
    outcome: dict[str, Any] = {}
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            assert proxy.stall() == 1

            def run() -> None:
                try:
                    outcome["value"] = conn.execute(sa.text("SELECT 2")).scalar_one()
                except sa.exc.OperationalError as exc:
                    outcome["error"] = exc

            began = time.monotonic()
            caller = threading.Thread(target=run, daemon=True)
            caller.start()
            caller.join(30)
            took = time.monotonic() - began
            hung = caller.is_alive()
            if hung:  # let it end, so that closing the connection does not wait on it
                proxy.resume()
                caller.join(30)
            assert not hung, "the statement is still waiting for its answer"
        assert "no answer from PostgreSQL within" in str(outcome.get("error")), outcome
        assert deadline - 0.2 <= took < deadline + 3, took
        with engine.connect() as conn:  # the hung connection is gone; a new one passes
            assert conn.execute(sa.text("SELECT 3")).scalar_one() == 3
    finally:
        proxy.close()
        engine.dispose()
