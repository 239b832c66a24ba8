"""The sweep's opt-in retention purge (``safe_time_delay_retention``) against real stores, with an
injected clock: no sleeping."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_safe_time import install
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore, delays
from celery_safe_time.delays.maintenance import PURGE_INTERVAL, purge_retained
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.exceptions import StoreError
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import fresh_sql_store, new_delay

pytestmark = pytest.mark.integration

DAY = 86400.0


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite_url", "postgres_url"])
def store_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    fresh_sql_store(url).close()
    return url


def retention_app(make_app: Callable[..., Celery], store_url: str, **conf: Any) -> tuple[Celery, SQLAlchemyStore]:
    app = make_app("retention", safe_time_store_url=store_url, **conf)
    install(app)
    define_tasks(app)
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    return app, store


def finished_rows(store: SQLAlchemyStore, prefix: str, *, age: float) -> None:
    """Rows ``<prefix>-<status>`` of every status, their ``updated_at`` moved ``age`` seconds back."""
    past = store.now() - timedelta(seconds=1)
    for status in ("sent", "expired", "failed", "claimed"):
        store.insert(new_delay(f"{prefix}-{status}", past))
    token = f"{prefix}-token"
    store.claim_due(limit=10, lookahead=0, token=token)
    store.mark_sent([f"{prefix}-sent"], token)
    store.mark_expired([f"{prefix}-expired"], token)
    store.mark_failed(f"{prefix}-failed", token, "boom")
    for status in ("cancelled", "pending"):
        store.insert(new_delay(f"{prefix}-{status}", past + timedelta(days=30)))
    store.cancel(f"{prefix}-cancelled")
    backdate(store, prefix, age)


def backdate(store: SQLAlchemyStore, prefix: str, age: float) -> None:
    stamp = store.now() - timedelta(seconds=age)
    with store.engine.begin() as conn:
        conn.execute(sa.update(delays).where(delays.c.id.startswith(prefix + "-")).values(updated_at=stamp))


def ids(store: SQLAlchemyStore) -> set[str]:
    return {r.id for r in store.list(limit=1000)}


def test_sweep_purges_old_finished_rows_once_per_interval(make_app: Callable[..., Celery], store_url: str) -> None:
    app, store = retention_app(make_app, store_url, safe_time_delay_retention=timedelta(days=7))
    finished_rows(store, "old", age=8 * DAY)
    finished_rows(store, "new", age=6 * DAY)
    clock = FakeClock()
    stats = sweep(app, clock=clock)
    assert stats.purged == 3
    assert stats.as_dict()["purged"] == 3
    # failed rows wait for an operator; pending and claimed rows are work still to do.
    assert ids(store) == {"old-failed", "old-claimed", "old-pending"} | {
        f"new-{s}" for s in ("sent", "expired", "failed", "claimed", "cancelled", "pending")
    }
    # Within the interval the next sweeps leave even newly old rows alone...
    backdate(store, "new", 8 * DAY)
    clock.now += PURGE_INTERVAL - 1
    assert sweep(app, clock=clock).purged == 0
    assert "new-sent" in ids(store)
    # ...and purge them once it has passed.
    clock.now += 1
    assert sweep(app, clock=clock).purged == 3
    assert ids(store) == {"old-failed", "old-claimed", "old-pending", "new-failed", "new-claimed", "new-pending"}


def test_no_retention_setting_keeps_every_row(make_app: Callable[..., Celery], store_url: str) -> None:
    app, store = retention_app(make_app, store_url)
    finished_rows(store, "old", age=3650 * DAY)
    assert sweep(app, clock=FakeClock()).purged == 0
    assert len(ids(store)) == 6


def test_a_capped_pass_goes_on_at_the_next_sweep(make_app: Callable[..., Celery], store_url: str) -> None:
    _, store = retention_app(make_app, store_url)
    past = store.now() - timedelta(seconds=1)
    for i in range(7):
        store.insert(new_delay(f"bulk-{i}", past))
    store.claim_due(limit=10, lookahead=0, token="t")
    store.mark_sent([f"bulk-{i}" for i in range(7)], "t")
    backdate(store, "bulk", 2 * DAY)
    clock = FakeClock()

    def purge() -> int:
        return purge_retained(store, DAY, clock=clock, batch=2, max_batches=2)

    # Two batches of two per sweep; a full pass carries on at once, a finished one waits the interval.
    assert [purge(), purge(), purge()] == [4, 3, 0]
    assert ids(store) == set()


def test_a_store_error_in_the_purge_does_not_fail_the_sweep(
    make_app: Callable[..., Celery], store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app, store = retention_app(make_app, store_url, safe_time_delay_retention=DAY)
    finished_rows(store, "old", age=2 * DAY)

    def broken(*args: Any, **kwargs: Any) -> int:
        raise StoreError("store went away")

    monkeypatch.setattr(store, "purge", broken)
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.delays.maintenance"):
        assert sweep(app, clock=clock).purged == 0
    assert "retention purge stopped after 0 rows" in caplog.text
    monkeypatch.undo()
    # The failed pass counts as this interval's: the next one runs an interval later.
    assert sweep(app, clock=clock).purged == 0
    clock.now += PURGE_INTERVAL
    assert sweep(app, clock=clock).purged == 3
