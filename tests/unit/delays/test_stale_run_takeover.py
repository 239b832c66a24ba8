"""The sweep takes a started run over only after it stayed silent while the store answered.

A store outage stops every heartbeat, so time the store was unreachable must not count towards a
run's staleness (fault soak, amqp seed 117620: a row suspected in a 1 s window between two cuts was
taken over right after the second cut, while its run was alive and recording its end).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time.config import SafeTimeConfig
from celery_safe_time.delays.backends.memory import MemoryStore
from celery_safe_time.delays.maintenance import confirm_deliveries, suspicion_look_gap
from celery_safe_time.delays.publish import SweepStats
from tests.helpers.delays import new_delay

TTL = 6.0
T0 = datetime(2026, 12, 5, 1, 0, tzinfo=timezone.utc)


class ClockedStore(MemoryStore):
    """The memory store on an injected clock."""

    def __init__(self) -> None:
        super().__init__()
        self.at = T0

    def now(self) -> datetime:
        return self.at

    def advance(self, seconds: float) -> None:
        self.at += timedelta(seconds=seconds)


@pytest.fixture
def app() -> Celery:
    app = Celery("stale-takeover-unit", broker="memory://", set_as_current=False)

    @app.task(shared=False, name="tests.delays.record", acks_late=True)
    def record(task_id: str) -> None:
        return None

    return app


CONFIG = SafeTimeConfig(redis_url="redis://unused", lock_ttl=TTL, sweep_interval=1.0)


def _started(store: ClockedStore) -> str:
    store.insert(new_delay("run", store.now() - timedelta(seconds=1)))
    [row] = store.claim_due(limit=1, lookahead=0, token="claim")
    assert row.delivery_token
    assert store.start("run", row.delivery_token, "run-1", "host-a", stale_after=TTL).verdict == "run"
    return row.delivery_token


def _sweep(app: Celery, store: ClockedStore) -> SweepStats:
    stats = SweepStats()
    confirm_deliveries(app, CONFIG, store, stats, limit=10)
    return stats


def _status(store: ClockedStore) -> str:
    row = store.get("run")
    assert row is not None
    return row.status


def test_a_suspicion_across_a_store_outage_starts_over(app: Celery) -> None:
    store = ClockedStore()
    token = _started(store)
    # The store goes down as the run starts: no heartbeat lands. It answers again for a moment,
    # when a sweep finds the heartbeat stale and suspects the run...
    store.advance(TTL + 1)
    assert _sweep(app, store).rerun == 0
    suspected = store.get("run")
    assert suspected is not None
    assert suspected.suspected_at == store.now()
    # ...then it is cut again for longer than the ttl: no sweep looks, no heartbeat lands.
    store.advance(TTL * 2)
    # The first look after it starts the suspicion over instead of taking the run over.
    assert _sweep(app, store).rerun == 0
    assert _status(store) == C.STATUS_STARTED
    again = store.get("run")
    assert again is not None
    assert again.suspected_at == store.now()
    # The live run's heartbeat lands once the store answers: the suspicion is cleared.
    store.advance(1.0)
    assert store.heartbeat("run", token, "run-1")
    for _ in range(int(TTL * 2)):
        store.advance(1.0)
        assert _sweep(app, store).rerun == 0
    assert _status(store) == C.STATUS_STARTED
    # It records its end: nothing is run again.
    assert store.finish("run", token, "run-1", C.OUTCOME_SUCCEEDED)


def test_a_dead_run_is_taken_over_after_a_ttl_of_silence_while_the_store_answers(app: Celery) -> None:
    store = ClockedStore()
    _started(store)
    store.advance(TTL + 1)
    assert _sweep(app, store).rerun == 0  # suspected
    store.advance(TTL * 2)  # an outage: nobody looks
    assert _sweep(app, store).rerun == 0  # suspected anew
    # The store answers each sweep (every second) from now on; the run's worker is gone.
    waited = 0.0
    while _status(store) == C.STATUS_STARTED:
        store.advance(1.0)
        waited += 1.0
        _sweep(app, store)
        assert waited <= TTL + 1, "a dead run must be taken over one ttl after the outage"
    assert waited > TTL
    assert _status(store) == C.STATUS_PENDING


def test_sweeps_that_look_on_time_take_a_dead_run_over(app: Celery) -> None:
    store = ClockedStore()
    _started(store)
    looks = 0
    while _status(store) == C.STATUS_STARTED:
        store.advance(1.0)
        looks += 1
        _sweep(app, store)
        assert looks <= 2 * TTL + 2  # both thresholds are strict: one look past each
    assert looks > 2 * TTL  # stale for a ttl, then suspected for as long


def test_the_look_gap_covers_the_sweep_interval_and_half_the_ttl() -> None:
    assert suspicion_look_gap(SafeTimeConfig(redis_url="redis://unused", lock_ttl=60.0, sweep_interval=5.0)) == 30.0
    # A sweep interval long against the ttl still lets sweeps on time take a dead run over.
    assert suspicion_look_gap(SafeTimeConfig(redis_url="redis://unused", lock_ttl=10.0, sweep_interval=8.0)) == 16.0
