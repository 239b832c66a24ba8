"""Bursts: the adaptive look-ahead and the batched publish of the sweep, on real Redis and real stores."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from kombu.exceptions import OperationalError

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays.backends import get_store, set_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.sweep import _measured_rate, sweep
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import fresh_sql_store, new_delay
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration


def _app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    app = make_app("bursts", task_queues=None, **conf)
    install(app)
    define_tasks(app)
    return app


def _queued(url: str, queue: str = "celery") -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def burst_store(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[SQLAlchemyStore]:
    url = sqlite_url if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    store = fresh_sql_store(url)
    yield store
    store.close()


def test_a_burst_due_soon_is_claimed_early_and_published_with_its_due_time(
    make_app: Callable[..., Celery], redis_url: str, burst_store: SQLAlchemyStore
) -> None:
    app = _app(make_app)
    set_store(app, burst_store)
    due = burst_store.now() + timedelta(seconds=8)
    burst_store.bulk_insert([new_delay(f"burst-{i:05d}", due) for i in range(3000)])
    # With the fixed 2 s look-ahead nothing would be claimed yet; 3,000 rows at the assumed 1,000 rows/s
    # take 3 s, so the sweep looks 2 + 6 s (+ one 5 s sweep interval) ahead and publishes the burst now.
    stats = sweep(app)
    assert stats.lookahead == pytest.approx(13.0, abs=0.01)
    assert stats.sent == 3000
    messages = _queued(redis_url)
    assert len(messages) == 3000
    assert {m["headers"]["eta"] for m in messages} == {due.isoformat()}
    assert burst_store.counts()[C.STATUS_SENT] == 3000


def test_a_lone_row_keeps_the_fixed_lookahead(make_app: Callable[..., Celery], redis_url: str) -> None:
    app = _app(make_app)
    store = get_store(app)
    store.insert(new_delay("later", store.now() + timedelta(seconds=20)))
    stats = sweep(app)
    assert stats.sent == 0
    assert stats.lookahead == pytest.approx(C.SWEEP_LOOKAHEAD, abs=0.01)


def test_the_lookahead_stops_at_sweep_max_ahead_rows(make_app: Callable[..., Celery], redis_url: str) -> None:
    app = _app(make_app, safe_time_sweep_max_ahead=100)
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    now = store.now()
    store.bulk_insert([new_delay(f"first-{i:03d}", now + timedelta(seconds=6)) for i in range(100)])
    store.bulk_insert([new_delay(f"second-{i:03d}", now + timedelta(seconds=9)) for i in range(100)])
    _measured_rate(store, 10.0)  # a slow sweeper: 200 rows would call for 2 + 40 s
    stats = sweep(app)
    # ... but the count stops at 100 rows, the 100th is due in 6 s: the look-ahead stops there.
    assert 5.0 < stats.lookahead <= 6.0
    assert stats.sent == 100
    assert {m["headers"]["id"].split("-")[0] for m in _queued(redis_url)} == {"first"}


def test_the_batched_publish_fires_the_publish_signals_and_stamps_each_attempt(
    make_app: Callable[..., Celery], redis_url: str
) -> None:
    app = _app(make_app)
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    store.bulk_insert([new_delay(f"sig-{i}", store.now()) for i in range(50)])
    before: list[dict[str, Any]] = []
    after: list[str] = []

    def on_before(sender: Any = None, headers: Any = None, routing_key: Any = None, **_: Any) -> None:
        before.append({"id": headers["id"], "attempt": headers.get(C.HEADER_ATTEMPT), "routing_key": routing_key})

    def on_after(sender: Any = None, headers: Any = None, **_: Any) -> None:
        after.append(headers["id"])

    before_task_publish.connect(on_before, weak=False)
    after_task_publish.connect(on_after, weak=False)
    try:
        assert sweep(app).sent == 50
    finally:
        before_task_publish.disconnect(on_before)
        after_task_publish.disconnect(on_after)
    assert sorted(b["id"] for b in before) == sorted(after) == sorted(f"sig-{i}" for i in range(50))
    assert all(b["attempt"] and b["routing_key"] == "celery" for b in before)
    queued = {m["headers"]["id"]: m for m in _queued(redis_url)}
    assert set(queued) == set(after)
    assert {m["headers"][C.HEADER_ATTEMPT] for m in queued.values()} == {b["attempt"] for b in before}


def _sweep_losing_the_broker_at(app: Celery, redis_server: RedisServer, publish: int) -> None:
    """Sweep, stopping the broker as the ``publish``-th message is built: the sweep must raise."""
    seen: list[str] = []

    def stop_there(sender: Any = None, headers: Any = None, **_: Any) -> None:
        seen.append(headers["id"])
        if len(seen) == publish:
            redis_server.stop()

    before_task_publish.connect(stop_there, weak=False)
    try:
        with pytest.raises(OperationalError):
            sweep(app)
    finally:
        before_task_publish.disconnect(stop_there)


def test_a_broker_lost_before_the_batch_is_flushed_sends_every_row_back_to_pending(
    make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    app = _app(make_app, broker_url=redis_server.url, safe_time_redis_url=redis_server.url, result_backend=None)
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    store.bulk_insert([new_delay(f"lost-{i:02d}", store.now()) for i in range(20)])
    _sweep_losing_the_broker_at(app, redis_server, 5)  # the first 5 are buffered, none went out
    counts = store.counts()
    assert counts[C.STATUS_PENDING] == 20, counts
    assert counts[C.STATUS_SENT] == 0, counts
    redis_server.start()
    assert sweep(app).sent == 20
    assert len(_queued(redis_server.url)) == 20


def test_a_batch_claimed_ahead_goes_back_to_pending_when_the_publish_before_it_fails(
    make_app: Callable[..., Celery], redis_server: RedisServer, burst_store: SQLAlchemyStore
) -> None:
    """The next batch is claimed (in a thread, on PostgreSQL) while this one publishes: a broker lost
    mid-batch must hand that claim back too, not leave it claimed until the claim timeout."""
    app = _app(
        make_app,
        broker_url=redis_server.url,
        safe_time_redis_url=redis_server.url,
        result_backend=None,
        safe_time_sweep_batch=5,
    )
    set_store(app, burst_store)
    burst_store.bulk_insert([new_delay(f"ahead-{i:02d}", burst_store.now()) for i in range(20)])
    # the second batch's pipeline fails; the third is claimed ahead by now
    _sweep_losing_the_broker_at(app, redis_server, 7)
    counts = burst_store.counts()
    assert counts[C.STATUS_SENT] == 5, counts
    assert counts[C.STATUS_PENDING] == 15, counts
    assert counts[C.STATUS_CLAIMED] == 0, counts
    redis_server.start()
    assert sweep(app).sent == 15
    # The restarted throwaway server kept nothing (no persistence): the first batch's 5 are gone with
    # it (the delivery record republishes them after the grace); the 15 handed back went out now.
    assert sorted(m["headers"]["id"] for m in _queued(redis_server.url)) == [f"ahead-{i:02d}" for i in range(5, 20)]
