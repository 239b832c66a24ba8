"""The delivery heartbeat's decisions, with the clock injected: a write that hangs does not hold up
the tick, and an acks_late run gives its row up once no heartbeat was written for its ttl."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_safe_time.delays.backends.memory import MemoryStore
from celery_safe_time.delays.delivery import _Heartbeat


class HangingStore(MemoryStore):
    """``heartbeat`` answers ``answer`` at once, or blocks until ``release`` is set when ``hang``."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = False
        self.answer = True
        self.release = threading.Event()
        self.calls = 0

    def heartbeat(self, task_id: str, token: str, run_id: str) -> bool:
        self.calls += 1
        if self.hang:
            self.release.wait(10)
        return self.answer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def task() -> Iterator[Any]:
    app = Celery("heartbeat", set_as_current=False)

    @app.task(name="tests.heartbeat", shared=False, bind=True)
    def beating(self: Any) -> None: ...

    beating.push_request(id="t-1")
    yield beating
    beating.pop_request()
    app.close()


def test_a_hanging_heartbeat_write_gives_the_row_up_after_its_ttl(task: Any) -> None:
    store, clock = HangingStore(), Clock()
    heartbeat = _Heartbeat(task, store, "tok", "run-1", ttl=3.0, clock=clock)
    assert heartbeat.interrupter is not None
    heartbeat.interrupter.enabled = False  # decide only; nothing to interrupt in this thread
    clock.now += 1.0
    assert heartbeat.beat(3.0)  # written
    store.hang = True
    clock.now += 1.0
    assert heartbeat.beat(3.0)  # unanswered, 1 s since the last one written
    clock.now += 1.0
    assert heartbeat.beat(3.0)  # the same write, still unanswered: no second one
    assert store.calls == 2
    clock.now += 1.0
    assert not heartbeat.beat(3.0)  # 3 s without a heartbeat written
    heartbeat.lost("")
    assert heartbeat.lost_reason is not None
    assert "no heartbeat written for 3.0s" in heartbeat.lost_reason
    store.release.set()


def test_a_refused_heartbeat_only_ends_the_heartbeat(task: Any) -> None:
    store, clock = HangingStore(), Clock()
    heartbeat = _Heartbeat(task, store, "tok", "run-1", ttl=3.0, clock=clock)
    store.answer = False  # the row moved on: rescheduled, or replaced by a new call
    assert not heartbeat.beat(3.0)
    heartbeat.lost("")
    assert heartbeat.lost_reason is None  # a new delivery, not this one run again: not interrupted


def test_a_run_that_is_not_run_again_never_gives_its_row_up_for_silence(task: Any) -> None:
    store, clock = HangingStore(), Clock()
    heartbeat = _Heartbeat(task, store, "tok", "run-1", ttl=float("inf"), clock=clock)
    assert heartbeat.interrupter is None
    store.hang = True
    for _ in range(5):
        clock.now += 100.0
        assert heartbeat.beat(3.0)
    store.release.set()


def test_after_the_body_ended_a_silent_heartbeat_keeps_trying_until_the_end_is_recorded(task: Any) -> None:
    """The run ended while the store was unreachable: its end is recorded in the background, and the
    heartbeat must go on past the ttl (a row left to go stale would be run a second time)."""
    store, clock = HangingStore(), Clock()
    heartbeat = _Heartbeat(task, store, "tok", "run-1", ttl=3.0, clock=clock)
    assert heartbeat.interrupter is not None
    heartbeat.interrupter.enabled = False
    store.hang = True
    heartbeat.disarm()
    for _ in range(5):
        clock.now += 1.0
        assert heartbeat.beat(3.0)  # 5 s of silence, past the 3 s ttl: still beating
    assert heartbeat.lost_reason is None
    store.hang = False
    store.release.set()
    clock.now += 1.0
    assert heartbeat.beat(3.0)  # the write that hung is answered
    clock.now += 1.0
    assert heartbeat.beat(3.0)  # and the next one is written at once
    assert heartbeat.last_ok == clock.now
