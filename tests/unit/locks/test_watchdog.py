"""Watchdog timing rules and the interrupter (threads, no Redis)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from celery_safe_time.locks.watchdog import Interrupter, Watchdog, renewal_ttl, retry_gap
from celery_safe_time.requeue import jittered


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
    assert "Redis unreachable" in lost[0]
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
