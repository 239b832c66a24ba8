"""Leases dated from the send (issue 38 part 4), with injected time: an acquire answered past
``LEASE_LATE_REPLY_SHARE`` of its lease is not held (released, the backend reported unavailable); a
held lock's watchdog counts from the send; beat's leader lease likewise."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time.beat.backends.memory import MemoryBeatData, MemoryClock, MemoryLease
from celery_safe_time.beat.leader import LeaderKeeper
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import CoordinationUnavailable
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.watchdog import Watchdog, retry_gap
from celery_safe_time.testing import MemoryLockBackend

OWNER = Owner(task_id="t1", identity="delivery-1", host=socket.gethostname(), pid=os.getpid())
OTHER = Owner(task_id="t2", identity="delivery-2", host=socket.gethostname(), pid=os.getpid())


def _ticks(*values: float) -> Callable[[], float]:
    """A clock that reads ``values`` in turn (the send, then the answer)."""
    it: Iterator[float] = iter(values)
    return lambda: next(it)


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("lease-dating", broker="redis://127.0.0.1:1/0", set_as_current=False)  # never reached
    yield app
    app.close()


def test_an_acquire_answered_in_time_is_held_and_dated_from_its_send(app: Celery) -> None:
    store = MemoryLockBackend(get_config(app))
    store.lease_clock = _ticks(100.0, 101.9)  # 1.9 s of a 6 s lease: under a third
    acquired = store.acquire("k", "tok", 6.0, OWNER)
    assert acquired.status == "acquired"
    assert acquired.sent_at == 100.0


def test_an_acquire_answered_after_its_lease_ended_is_released_and_not_held(app: Celery) -> None:
    """The issue's case: ttl 6, the answer 8 s after the send. Before: held, dated from the answer."""
    store = MemoryLockBackend(get_config(app))
    store.lease_clock = _ticks(100.0, 108.0)
    with pytest.raises(CoordinationUnavailable, match=r"answered 8\.00s after it was sent"):
        store.acquire("k", "tok", 6.0, OWNER)
    # Given back: another caller takes it at once.
    store.lease_clock = _ticks(200.0, 200.0)
    assert store.acquire("k", "other", 6.0, OTHER).status == "acquired"


def test_an_answer_too_late_for_the_first_renewal_is_not_held_either(app: Celery) -> None:
    store = MemoryLockBackend(get_config(app))
    store.lease_clock = _ticks(0.0, 6.0 * C.LEASE_LATE_REPLY_SHARE + 0.01)
    with pytest.raises(CoordinationUnavailable):
        store.acquire("k", "tok", 6.0, OWNER)


def test_the_watchdog_counts_the_lease_from_the_send() -> None:
    sent = time.monotonic() - 5.0  # the acquire left 5 s ago; its answer came just now
    watchdog = Watchdog(lambda ttl: True, lambda reason: None, ttl=30.0, interval=10.0).start(sent)
    try:
        assert watchdog.last_ok == sent
        assert watchdog.due == sent + 10.0  # the first renewal a third of the lease after the send
        assert watchdog.gives_up_at == sent + 30.0 - retry_gap(30.0, 10.0)
    finally:
        watchdog.stop()


def test_beat_does_not_take_a_leader_lease_answered_too_late(app: Celery) -> None:
    config = get_config(app)
    data = MemoryBeatData()
    lease = MemoryLease(data, config)
    keeper = LeaderKeeper(lease, MemoryClock(data), config, sender=None)
    keeper.lease_clock = _ticks(0.0, config.beat_lease)  # the answer a whole lease after the send
    assert keeper._attempt()
    assert not keeper.is_leader
    assert data.token is None, "the late lease was given back"

    keeper.lease_clock = _ticks(50.0, 50.1)
    assert keeper._attempt()
    assert keeper.is_leader
