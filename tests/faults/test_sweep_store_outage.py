"""A sweep that published rows but could not mark them sent: it retries within half the claim
timeout, and past that says so, naming the rows."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays.backends.memory import MemoryStore
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.publish import SWEEP_MARK_RETRY_DELAYS, mark_sent_retrying
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.exceptions import StoreError
from tests.apps.delays_tasks import define_tasks
from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers.delays import fresh_sql_store, new_delay, utcnow


class FailingMarks(MemoryStore):
    """``mark_sent`` raises ``StoreError`` ``failures`` times (forever when None), then works."""

    def __init__(self, failures: int | None) -> None:
        super().__init__()
        self.failures = failures
        self.calls = 0

    def mark_sent(self, task_ids: Sequence[str], token: str) -> int:
        self.calls += 1
        if self.failures is None or self.calls <= self.failures:
            raise StoreError("store postgresql://db/app: OperationalError: server closed the connection")
        return super().mark_sent(task_ids, token)


def memory_app(**conf: Any) -> Celery:
    app = Celery("ctx", set_as_current=False)
    app.conf.update(
        broker_url="memory://", safe_time_redis_url="redis://127.0.0.1:1/0", safe_time_store_url="memory://", **conf
    )
    install(app)

    @app.task(name="tests.delays.record", shared=False)
    def record(label: str) -> None: ...

    return app


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def claimed(store: MemoryStore, ids: list[str]) -> str:
    for task_id in ids:
        store.insert(new_delay(task_id, utcnow() - timedelta(seconds=1)))
    token = "tok"
    assert len(store.claim_due(limit=10, lookahead=0, token=token)) == len(ids)
    return token


def test_mark_sent_is_retried_until_the_store_answers(caplog: pytest.LogCaptureFixture) -> None:
    store, fake = FailingMarks(failures=3), FakeTime()
    token = claimed(store, ["a", "b"])
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.delays.publish"):
        marked = mark_sent_retrying(store, ["a", "b"], token, budget=150, sleep=fake.sleep, clock=fake.clock)
    assert marked == 2
    assert fake.slept == list(SWEEP_MARK_RETRY_DELAYS[:3])
    assert [store.get(i).status for i in "ab"] == ["sent", "sent"]  # type: ignore[union-attr]
    messages = [r.getMessage() for r in caplog.records]
    assert "could not mark them sent" in messages[0]
    assert "retrying for up to 150s" in messages[0]
    assert messages[-1] == "sweep: marked 2 published stored delays sent after 3 retries"


def test_mark_sent_gives_up_within_the_budget_naming_the_rows(caplog: pytest.LogCaptureFixture) -> None:
    store, fake = FailingMarks(failures=None), FakeTime()
    token = claimed(store, ["row-1"])
    with caplog.at_level(logging.ERROR, logger="celery_safe_time.delays.publish"), pytest.raises(StoreError):
        mark_sent_retrying(store, ["row-1"], token, budget=20, sleep=fake.sleep, clock=fake.clock)
    assert fake.now - 1000.0 <= 20
    assert sum(fake.slept) > 10  # it did keep trying
    message = caplog.records[-1].getMessage()
    assert "published 1 stored delays but could not mark them sent within 20s" in message
    assert "row-1" in message
    assert "OperationalError" in message
    assert store.get("row-1").status == "claimed"  # type: ignore[union-attr]


def test_sweep_that_cannot_mark_raises_after_half_the_claim_timeout(caplog: pytest.LogCaptureFixture) -> None:
    app = memory_app(safe_time_claim_timeout=2)  # budget 1 s: one 0.5 s retry
    store = FailingMarks(failures=None)
    store.insert(new_delay("row-1", utcnow() - timedelta(seconds=1)))
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.delays.publish"), pytest.raises(StoreError):
        sweep(app, store=store)
    assert store.calls == 2
    assert "could not mark them sent within 1s" in caplog.records[-1].getMessage()
    assert store.get("row-1").status == "claimed"  # type: ignore[union-attr]
    app.close()


@pytest.fixture
def proxied_store_url(postgres_url: str) -> Iterator[tuple[str, TcpProxy]]:
    proxy, url = proxy_for(postgres_url)
    yield url, proxy
    proxy.close()


def test_postgres_cut_after_publish_marks_the_batch_sent_when_it_returns(
    make_app: Callable[..., Celery],
    postgres_url: str,
    proxied_store_url: tuple[str, TcpProxy],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real PostgreSQL behind a TCP proxy, cut right after the batch's last publish, back 3 s later:
    the sweep waits it out and marks the batch sent instead of leaving it to be re-published."""
    url, proxy = proxied_store_url
    fresh_sql_store(postgres_url).close()
    app = make_app("mark-retry", safe_time_store_url=url, safe_time_claim_timeout=60)
    install(app)
    define_tasks(app)
    store = SQLAlchemyStore(url)
    ids = [f"cut-{i:03d}" for i in range(20)]
    store.bulk_insert([new_delay(i, store.now() - timedelta(seconds=1)) for i in ids])
    published: list[str] = []

    def on_publish(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        published.append((headers or {})["id"])
        if len(published) == len(ids):
            proxy.cut()
            threading.Timer(3.0, proxy.restore).start()

    after_task_publish.connect(on_publish, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_safe_time.delays.publish"):
            stats = sweep(app, store=store)
    finally:
        after_task_publish.disconnect(on_publish)
    assert proxy.cuts == 1
    assert stats.sent == 20
    assert sorted(published) == ids
    assert store.counts()[C.STATUS_SENT] == 20
    queued = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)]
    assert sorted(queued) == ids  # published once each
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not mark them sent" in m and "retrying" in m for m in messages), messages
    assert any(m.startswith("sweep: marked 20 published stored delays sent after") for m in messages), messages
    store.close()
    app.close()


class BackgroundMarks(FailingMarks):
    """As a server database's store: the sweep claims ahead and marks in threads of its own."""

    claims_in_background = True

    def __init__(self, failures: int | None) -> None:
        super().__init__(failures)
        self.mark_threads: set[str] = set()

    def mark_sent(self, task_ids: Sequence[str], token: str) -> int:
        self.mark_threads.add(threading.current_thread().name)
        return super().mark_sent(task_ids, token)


def test_marks_in_the_background_count_and_signal_every_batch_after_its_publish() -> None:
    """Issue 20: a batch's mark sent runs in the sweep's mark thread while the next batch publishes;
    every row is marked once, after its batch's publish, and delay_released fires in the sweep's thread."""
    app = memory_app()
    store = BackgroundMarks(failures=0)
    ids = [f"bg-{i:02d}" for i in range(25)]
    for task_id in ids:
        store.insert(new_delay(task_id, utcnow() - timedelta(seconds=1)))
    published: list[str] = []
    released: list[tuple[str, str]] = []

    def on_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
        assert headers is not None
        # Published before marked: a row is still claimed when its message goes out.
        assert store.get(headers["id"]).status == "claimed"  # type: ignore[union-attr]
        published.append(headers["id"])

    def on_released(task_id: str = "", **_: Any) -> None:
        released.append((task_id, threading.current_thread().name))

    from celery_safe_time import signals

    after_task_publish.connect(on_publish, weak=False)
    signals.delay_released.connect(on_released, weak=False)
    try:
        stats = sweep(app, store=store, batch=10)
    finally:
        after_task_publish.disconnect(on_publish)
        signals.delay_released.disconnect(on_released)
        app.close()
    assert stats.sent == 25
    assert stats.batches == 3
    assert sorted(published) == ids
    assert [store.get(i).status for i in ids] == ["sent"] * 25  # type: ignore[union-attr]
    assert sorted(r[0] for r in released) == ids
    assert {r[1] for r in released} == {threading.current_thread().name}
    assert store.mark_threads
    assert all(name.startswith("safe-time-mark") for name in store.mark_threads)


def test_a_background_mark_that_fails_fails_the_sweep_and_leaves_its_rows_claimed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = memory_app(safe_time_claim_timeout=2)  # budget 1 s: one 0.5 s retry per batch
    store = BackgroundMarks(failures=None)
    for i in range(15):
        store.insert(new_delay(f"bgf-{i:02d}", utcnow() - timedelta(seconds=1)))
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.delays.publish"), pytest.raises(StoreError):
        sweep(app, store=store, batch=10)
    app.close()
    rows = [store.get(f"bgf-{i:02d}") for i in range(15)]
    assert {r.status for r in rows if r is not None} == {"claimed"}  # re-published after the claim timeout
    assert any("could not mark them sent within" in r.getMessage() for r in caplog.records)
