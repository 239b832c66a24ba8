"""``rate_take`` on every lock backend (Redis script, PostgreSQL function, memory) call for call, and
in-process ``concurrency_limit`` calls on each coordination backend (no workers)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import concurrency_limit, rate_limit
from celery_safe_time.exceptions import LockConflict, RateLimited
from celery_safe_time.locks import current_lock
from celery_safe_time.locks.backends import LockBackend, RateCount
from celery_safe_time.locks.rates import Rate

pytestmark = pytest.mark.integration


def fresh(name: str) -> str:
    """A key no other test (nor an earlier run on the same database) has used."""
    return f"{name}-{uuid.uuid4().hex[:12]}"


def test_a_full_log_refuses_with_the_wait_until_its_oldest_entry_ages_out(lock_backend: LockBackend) -> None:
    k, other = fresh("k"), fresh("other")
    rate = Rate(3, 0.6)
    first = time.monotonic()
    assert [lock_backend.rate_take(k, f"t{i}", rate).used for i in range(3)] == [1, 2, 3]
    refused = lock_backend.rate_take(k, "t3", rate)
    assert not refused.admitted
    assert refused.used == 4  # the reservation is an entry too
    assert 0.0 < refused.wait <= 0.6
    early = lock_backend.rate_take(k, "t3", rate)  # back before its reservation is due
    assert not early.admitted
    assert early.wait <= refused.wait
    behind = lock_backend.rate_take(k, "t4", rate)
    assert not behind.admitted
    assert lock_backend.rate_take(other, "t4", rate).admitted  # keys are independent
    # The wait is the backend's own answer: after it (plus clock granularity) the reservation is due.
    time.sleep(refused.wait + 0.02)
    again = lock_backend.rate_take(k, "t3", rate)
    assert again.admitted, again
    assert time.monotonic() - first >= 0.6 - 0.05


def test_a_given_up_reservation_frees_its_place_and_never_an_admitted_call(lock_backend: LockBackend) -> None:
    k = fresh("k")
    rate = Rate(1, 30.0)
    assert lock_backend.rate_take(k, "a", rate).admitted
    assert not lock_backend.rate_take(k, "b", rate).admitted  # b reserves the place at +30 s
    assert not lock_backend.rate_release(k, "a")  # an admitted call's entry stays: the limit holds
    assert lock_backend.rate_release(k, "b")
    assert not lock_backend.rate_release(k, "b")
    waiting = lock_backend.rate_take(k, "c", rate)
    assert not waiting.admitted
    assert waiting.used == 2  # a and c: b's place is gone
    assert 0.0 < waiting.wait <= 30.0


def test_a_direct_call_reserves_nothing(lock_backend: LockBackend) -> None:
    k = fresh("k")
    rate = Rate(1, 30.0)
    assert lock_backend.rate_take(k, "a", rate).admitted
    probes = [lock_backend.rate_take(k, f"p{i}", rate, reserve=False) for i in range(3)]
    assert [p.used for p in probes] == [1, 1, 1]
    assert lock_backend.rate_take(k, "q", rate).used == 2  # the first reservation


def test_a_lowered_limit_refuses_until_enough_entries_age_out(lock_backend: LockBackend) -> None:
    k = fresh("k")
    for i in range(4):
        assert lock_backend.rate_take(k, f"t{i}", Rate(4, 0.5)).admitted
    refused = lock_backend.rate_take(k, "x", Rate(2, 0.5))
    assert not refused.admitted
    assert refused.used == 5


def test_concurrent_callers_never_get_more_than_the_limit(lock_backend: LockBackend) -> None:
    hot = fresh("hot")
    rate = Rate(25, 30.0)
    admitted: list[bool] = []
    mutex = threading.Lock()

    def hammer(n: int) -> None:
        for i in range(10):
            taken = lock_backend.rate_take(hot, f"{n}-{i}", rate)
            with mutex:
                admitted.append(taken.admitted)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(admitted) == 60
    assert sum(admitted) == 25  # the other 35 hold reservations, due once the period has passed


def test_rate_limited_direct_calls(make_app: Callable[..., Celery], coordination_conf: dict[str, Any]) -> None:
    app = make_app(safe_time_key_prefix=fresh("p") + ":", **coordination_conf)

    @app.task(shared=False)
    @rate_limit("stripe:{account_id}", "2/m")
    def charge(account_id: int) -> int:
        return account_id

    assert [charge(1), charge(1), charge(2)] == [1, 1, 2]
    with pytest.raises(RateLimited) as info:
        charge(1)
    assert 55.0 < info.value.wait <= 60.0


def test_concurrency_limit_slots(make_app: Callable[..., Celery], coordination_conf: dict[str, Any]) -> None:
    app = make_app(safe_time_key_prefix=fresh("p") + ":", **coordination_conf)
    release = threading.Event()
    inside = threading.Semaphore(0)
    held: list[tuple[str, int]] = []

    @app.task(shared=False)
    @concurrency_limit("export:{tenant_id}", limit=2, ttl=5, on_conflict="raise")
    def export(tenant_id: int) -> None:
        lock = current_lock()
        assert lock is not None
        held.append((lock.key, lock.fence))
        inside.release()
        release.wait(10)

    threads = [threading.Thread(target=export, args=(1,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert inside.acquire(timeout=10)
    with pytest.raises(LockConflict):
        export(1)
    release.set()
    for thread in threads:
        thread.join(10)
    assert sorted(key for key, _ in held) == ["slot:export:1#0", "slot:export:1#1"]
    before = dict(held)
    held.clear()
    export(1)
    [(key, fence)] = held
    assert fence > before[key], "each slot's fence grows with its holders"


def test_rate_counts_show_calls_started_in_the_window_and_calls_waiting(lock_backend: LockBackend) -> None:
    k, other = fresh("count"), fresh("count-other")
    rate = Rate(2, 30.0)
    assert [lock_backend.rate_take(k, f"t{i}", rate).admitted for i in range(4)] == [True, True, False, False]
    assert lock_backend.rate_take(other, "o", rate).admitted
    assert lock_backend.rate_take(k, "probe", rate, reserve=False).used == 4  # a direct call adds nothing
    assert lock_backend.rate_counts(k) == [RateCount(k, 2, 2)]
    found = lock_backend.rate_counts("count*")
    assert RateCount(k, 2, 2) in found
    assert RateCount(other, 1, 0) in found
    # at most `limit` keys, whichever the scan meets first (SCAN's order is not the keys' order)
    limited = lock_backend.rate_counts("count*", limit=1)
    assert len(limited) == 1
    assert limited[0].key.startswith("count")
    assert lock_backend.rate_counts(fresh("nothing")) == []


def test_rate_counts_forget_calls_older_than_the_period(lock_backend: LockBackend) -> None:
    k = fresh("aged")
    rate = Rate(3, 0.3)
    assert lock_backend.rate_take(k, "a", rate).admitted
    assert lock_backend.rate_counts(k) == [RateCount(k, 1, 0)]
    time.sleep(0.35)
    assert lock_backend.rate_counts(k) == []  # gone from the window (Redis: the set expired too)


def test_the_flow_section_shows_slots_and_rate_keys(
    make_app: Callable[..., Celery], coordination_conf: dict[str, Any]
) -> None:
    from celery_safe_time.locks.admin import describe_flow

    app = make_app(safe_time_key_prefix=fresh("p") + ":", **coordination_conf)
    release = threading.Event()
    inside = threading.Semaphore(0)

    @app.task(shared=False)
    @concurrency_limit("export:{tenant_id}", limit=3, ttl=5)
    def export(tenant_id: int) -> None:
        inside.release()
        release.wait(10)

    @app.task(shared=False)
    @rate_limit("stripe:{account_id}", "2/m")
    def charge(account_id: int) -> int:
        return account_id

    assert describe_flow(app) == {
        "slots_held": 0,
        "concurrency": [],
        "rate_keys": 0,
        "waiting": 0,
        "rates": [],
        "capped": False,
    }
    threads = [threading.Thread(target=export, args=(7,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert inside.acquire(timeout=10)
    charge(1)
    charge(1)
    charge(2)
    try:
        flow = describe_flow(app)
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
    assert flow["slots_held"] == 2
    [slots] = flow["concurrency"]
    assert slots["key"] == "export:7"
    assert slots["held"] == 2
    assert set(slots["slots"]) <= {"slot:export:7#0", "slot:export:7#1", "slot:export:7#2"}
    assert flow["rates"] == [
        {"key": "stripe:1", "started": 2, "waiting": 0},
        {"key": "stripe:2", "started": 1, "waiting": 0},
    ]
    assert flow["rate_keys"] == 2
    assert describe_flow(app)["slots_held"] == 0
