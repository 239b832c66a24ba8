"""One way to wait (issue 38 part 3): a gate's re-queue goes to the broker only at or below the delay
threshold, to the store beyond it, for plain tasks too; the stored copy keeps its place in the limit
and runs once. In this process, on the testing kit's store and lock backend."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import overlap_lock, rate_limit
from celery_safe_time.clock import as_utc
from celery_safe_time.locks.backends import Owner
from celery_safe_time.messages.requeue import wait_route
from celery_safe_time.testing import SafeTimeTesting, safe_time_testing

THRESHOLD = 10.0


@pytest.mark.parametrize(
    ("countdown", "threshold", "route"),
    [(0.0, 0.0, "broker"), (9.99, 10.0, "broker"), (10.0, 10.0, "broker"), (10.01, 10.0, "store"), (3600, 2, "store")],
)
def test_a_wait_goes_to_the_broker_only_up_to_the_threshold(countdown: float, threshold: float, route: str) -> None:
    assert wait_route(countdown, threshold) == route


@pytest.fixture
def st() -> Iterator[SafeTimeTesting]:
    app = Celery("gate-waits-unit", broker="memory://", set_as_current=False)
    with safe_time_testing(app, threshold=THRESHOLD) as handle:
        yield handle


def _rated(st: SafeTimeTesting, rate: str, ran: list[Any]) -> Any:
    @st.app.task(shared=False, name="tests.gate_waits.rated")
    @rate_limit("gate-waits:{key}", rate)
    def rated(key: str, n: int) -> int:
        ran.append(n)
        return n

    return rated


def test_a_plain_task_waiting_past_the_threshold_is_stored_and_runs_once_in_its_place(st: SafeTimeTesting) -> None:
    """Before: the limiter sent the 60 s wait of a plain task through the broker (nothing stored)."""
    ran: list[int] = []
    rated = _rated(st, "1/m", ran)
    assert st.deliver(rated, ("a", 0)).state == "SUCCESS"
    assert st.deliver(rated, ("a", 1), task_id="second").state == "RETRY"

    [row] = st.stored_delays(rated)
    assert row.id == "second"
    assert row.args == ("a", 1)
    headers = row.options["headers"]
    # It keeps its place: its reservation's token travels with it, and it continues its delivery.
    assert headers[C.HEADER_RATE_TOKEN]
    assert C.HEADER_LOCK_ORIGIN in headers
    assert (row.due_at - st.now()).total_seconds() == pytest.approx(60 - C.RATE_LEAD, abs=1)

    assert st.run_due(advance=30) == []
    [result] = st.run_due(advance=31)
    assert result.state == "SUCCESS"
    assert ran == [0, 1]
    # The delivery record was checked and closed: a copy published again would not run.
    stored = st.store.get("second")
    assert stored is not None
    assert (stored.status, stored.outcome) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED)


def test_a_wait_at_or_below_the_threshold_stays_in_the_broker(st: SafeTimeTesting) -> None:
    ran: list[int] = []
    rated = _rated(st, "1/5s", ran)
    assert st.deliver(rated, ("b", 0)).state == "SUCCESS"
    assert st.deliver(rated, ("b", 1)).state == "RETRY"
    assert st.stored_delays(rated) == []


def test_without_the_sweep_a_long_wait_comes_back_at_the_threshold_and_waits_again(st: SafeTimeTesting) -> None:
    """An app without ``install(app)`` would never send a stored row: the call comes back from the
    broker after the threshold (never later) and waits again from there, keeping its place."""
    from celery.signals import before_task_publish

    from celery_safe_time import install_check

    install_check._run_otherwise.discard(st.app)
    etas: list[tuple[float, str]] = []

    def sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("eta"):
            etas.append((time.time(), str(headers["eta"])))

    before_task_publish.connect(sent, weak=False)
    try:
        ran: list[int] = []
        rated = _rated(st, "1/m", ran)
        assert st.deliver(rated, ("c", 0)).state == "SUCCESS"
        assert st.deliver(rated, ("c", 1)).state == "RETRY"
    finally:
        before_task_publish.disconnect(sent)
    assert st.stored_delays(rated) == []
    [(at, eta)] = etas
    assert as_utc(eta).timestamp() - at == pytest.approx(THRESHOLD, abs=2.0)


def test_a_store_that_cannot_take_the_wait_does_not_lose_the_call(
    st: SafeTimeTesting, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store refuses the row (down): the call comes back from the broker at the threshold instead
    of failing with the gate's error."""
    from celery_safe_time.exceptions import StoreError

    def down(*_: Any, **__: Any) -> Any:
        raise StoreError("store memory://testing: OperationalError: the store is down")

    ran: list[int] = []
    rated = _rated(st, "1/m", ran)
    assert st.deliver(rated, ("d", 0)).state == "SUCCESS"
    monkeypatch.setattr(st.store, "insert", down)
    assert st.deliver(rated, ("d", 1)).state == "RETRY"
    assert st.stored_delays(rated) == []


def test_an_overlap_lock_conflict_waiting_past_the_threshold_is_stored_too(st: SafeTimeTesting) -> None:
    """Every gate's re-queue follows the rule, not only the rate limiter's: here ``retry_after``."""
    ran: list[str] = []

    @st.app.task(shared=False, name="tests.gate_waits.locked")
    @overlap_lock("gate-waits-lock:{key}", retry_after=30, jitter=0)
    def locked(key: str) -> str:
        ran.append(key)
        return key

    holder = Owner(task_id="elsewhere", identity="elsewhere", host="h", pid=1)
    assert st.locks.acquire("gate-waits-lock:e", "held-elsewhere", 600, holder).status == "acquired"
    assert st.deliver(locked, ("e",), task_id="waiting").state == "RETRY"
    [row] = st.stored_delays(locked)
    assert row.id == "waiting"
    assert (row.due_at - st.now()).total_seconds() == pytest.approx(30, abs=1)
    assert ran == []
