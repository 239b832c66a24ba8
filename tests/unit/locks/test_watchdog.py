"""Watchdog timing rules and the interrupter (threads, no Redis)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import redis

from celery_safe_time.locks.watchdog import Interrupter, Watchdog, renewal_ttl, retry_gap
from celery_safe_time.messages.requeue import jittered
from tests.helpers.processes import wait_for


def test_renewal_ttl_is_capped_at_the_hard_time_limit() -> None:
    assert renewal_ttl(60, now=100, hard_deadline=None, margin=1) == 60
    assert renewal_ttl(60, now=100, hard_deadline=110, margin=1) == 11
    assert renewal_ttl(5, now=100, hard_deadline=110, margin=1) == 5
    assert renewal_ttl(60, now=120, hard_deadline=110, margin=1) == 0.001


def test_retry_gap_fits_several_tries_before_expiry() -> None:
    assert retry_gap(60, 20) == 6
    assert retry_gap(0.3, 0.1) == 0.05


def test_jitter_stays_within_bounds() -> None:
    assert jittered(10, 5, rand=lambda: 0.0) == 10
    assert jittered(10, 5, rand=lambda: 0.999) == pytest.approx(14.995)


def test_watchdog_renews_until_stopped() -> None:
    asked: list[float] = []
    watchdog = Watchdog(lambda ttl: asked.append(ttl) or True, lambda reason: None, ttl=0.3, interval=0.05).start()
    time.sleep(0.4)
    watchdog.stop()
    count = len(asked)
    time.sleep(0.15)
    assert count >= 4
    assert len(asked) == count
    assert set(asked) == {0.3}


def test_watchdog_reports_a_refused_renewal_once() -> None:
    lost: list[str] = []
    watchdog = Watchdog(lambda ttl: False, lost.append, ttl=0.3, interval=0.05).start()
    time.sleep(0.3)
    watchdog.stop()
    assert lost == ["the lock expired or is held by someone else"]


def test_watchdog_tolerates_short_outages_then_gives_up_before_expiry() -> None:
    calls: list[float] = []
    lost: list[str] = []
    outage = threading.Event()
    outage.set()

    def renew(ttl: float) -> bool:
        calls.append(time.monotonic())
        if outage.is_set() and len(calls) == 1:
            raise redis.ConnectionError("blip")
        return True

    flaky = Watchdog(renew, lost.append, ttl=0.6, interval=0.1).start()
    time.sleep(0.5)
    flaky.stop()
    assert lost == []  # one failed renewal, then success again

    def down(ttl: float) -> bool:
        raise redis.ConnectionError("down")

    told_at: list[float] = []

    def on_lost(reason: str) -> None:
        told_at.append(time.monotonic())
        lost.append(reason)

    started = time.monotonic()
    watchdog = Watchdog(down, on_lost, ttl=0.6, interval=0.2).start()
    while not lost and time.monotonic() - started < 3:
        time.sleep(0.01)
    watchdog.stop()
    assert lost
    assert "unreachable" in lost[0].lower()
    # told no later than the lock's expiry (a little slack for a loaded machine's scheduler)
    assert told_at[0] - started < 0.6 + 0.15


def test_interrupter_raises_in_the_target_thread_only_while_armed() -> None:
    outcome: list[str] = []
    ready = threading.Event()

    def body() -> None:
        interrupter = Interrupter()
        holder.append(interrupter)
        ready.set()
        try:
            for _ in range(200):
                time.sleep(0.01)
            outcome.append("finished")
        except KeyError:
            outcome.append("interrupted")
        finally:
            interrupter.disarm()

    holder: list[Interrupter] = []
    thread = threading.Thread(target=body)
    thread.start()
    ready.wait(2)
    assert holder[0].fire(KeyError)
    thread.join(5)
    assert outcome == ["interrupted"]
    assert not holder[0].fire(KeyError)  # disarmed: never again


def _hanging(seconds: float) -> Callable[[float], bool]:
    """A renewal that gets no answer for ``seconds`` and then times out, as on a stalled connection."""

    def renew(ttl: float) -> bool:
        time.sleep(seconds)
        raise redis.TimeoutError("Timeout reading from socket")

    return renew


def test_many_locks_whose_renewals_hang_are_each_told_before_their_lease_ends() -> None:
    """Six locks of one process, each renewal blocking 2 s (a socket timeout) against a 1.2 s lease.
    When one thread ran the renewals one after another, each waited out the socket timeout and the
    ones behind it, and the last was told ~12 s after its lease ended. Now each is told before its
    own lease ends, whatever the others do."""
    told: dict[int, float] = {}
    started = time.monotonic()
    watchdogs = [
        Watchdog(_hanging(2.0), lambda reason, i=i: told.setdefault(i, time.monotonic()), ttl=1.2, interval=0.4).start()
        for i in range(6)
    ]
    while len(told) < 6 and time.monotonic() - started < 15:
        time.sleep(0.01)
    for watchdog in watchdogs:
        watchdog.stop()
    assert sorted(told) == list(range(6))
    # told no later than the lease's end (a little slack for a loaded machine's scheduler)
    assert max(told.values()) - started < 1.2 + 0.15


def test_a_hanging_renewal_does_not_hold_up_the_other_locks_or_stop() -> None:
    """One lock's renewal hangs; another lock of the same process keeps being renewed, and stopping
    the hanging one returns at once (the task thread is never stuck behind a renewal in flight).

    It waits for the renewals instead of counting those of a fixed 0.8 s, which found none on a
    loaded machine (the wheel's unit tests beside six test workers); the long ttls keep a late
    renewal from ending either lock."""
    release = threading.Event()
    hanging = threading.Event()

    def stuck(ttl: float) -> bool:
        hanging.set()
        release.wait(60)
        return True

    asked: list[float] = []
    hung = Watchdog(stuck, lambda reason: None, ttl=60.0, interval=0.1).start()
    healthy = Watchdog(lambda ttl: asked.append(ttl) or True, lambda reason: None, ttl=30.0, interval=0.1).start()
    try:
        assert hanging.wait(30)
        wait_for(lambda: len(asked) >= 4, 30, interval=0.05, message="the healthy lock's renewals beside the hung one")
        began = time.monotonic()
        hung.stop()
        stopped_in = time.monotonic() - began
    finally:
        healthy.stop()
        release.set()
    assert stopped_in < 0.1  # the hanging call goes on for up to 60 s


def test_slow_renewals_that_answer_before_the_lease_ends_keep_the_lock() -> None:
    """Each renewal takes 0.4 s of a 1.2 s lease: late, but always before the give-up point, so the
    lock is never reported lost and keeps being renewed."""
    asked: list[float] = []
    lost: list[str] = []

    def slow(ttl: float) -> bool:
        asked.append(time.monotonic())
        time.sleep(0.4)
        return True

    watchdog = Watchdog(slow, lost.append, ttl=1.2, interval=0.4).start()
    time.sleep(3.0)
    watchdog.stop()
    assert lost == []
    assert len(asked) >= 4
