"""Jitter and the catch-up window in ``SafeScheduler`` on the in-memory beat backend, time injected:
each jittered slot is published once at its computed offset, also across a hand-over; slots later
than the catch-up window are skipped and counted."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from celery_safe_time.beat.backends.memory import MemoryBeatData
from celery_safe_time.beat.policies import beat_slots_past_catchup, jitter_offset
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import get_config
from celery_safe_time.metrics import disable_metrics, enable_metrics
from tests.unit.beat.conftest import T0, FakeTime, OnDispatched, memory_app


@pytest.fixture
def sent(clock: FakeTime, on_dispatched: OnDispatched) -> list[tuple[str, float, float, int]]:
    """(entry, slot, the clock when published, epoch) of every publish."""
    out: list[tuple[str, float, float, int]] = []

    def on_sent(sender: Any, entry: str, slot: Any, epoch: int, **kw: Any) -> None:
        out.append((entry, slot.timestamp(), clock.now, epoch))

    on_dispatched(on_sent)
    return out


def _noop() -> None:
    return None


def _scheduler(tmp_path: Path, name: str, schedule: dict[str, Any]) -> SafeScheduler:
    app = memory_app("memory-beat-policies", beat_schedule=schedule)
    app.task(name="t.policies_noop", shared=False)(_noop)
    get_config(app)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / name), max_interval=1)
    sched.keeper._stop.set()  # drive the lease by hand (``_attempt``), on the injected clock
    return sched


def _attempt(sched: SafeScheduler) -> None:
    """One lease round by hand: renew (the leader) or acquire (a standby)."""
    sched.keeper._stop.clear()
    assert sched.keeper._attempt()
    sched.keeper._stop.set()


def _run(sched: SafeScheduler, clock: FakeTime, until: float) -> None:
    """Tick every STEP up to ``until``, renewing the lease every few seconds of the fake clock."""
    while clock.now < until:
        if clock.now % 5 < STEP:
            _attempt(sched)
        sched.tick()
        clock.now += STEP


STEP = 0.25


def test_jittered_entries_publish_each_slot_once_at_its_offset_across_a_hand_over(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, float, int]]
) -> None:
    names = [f"tenant-{i}" for i in range(40)]
    schedule = {n: {"task": "t.policies_noop", "schedule": 60.0, "jitter": dt.timedelta(seconds=30)} for n in names}
    a = _scheduler(tmp_path, "a", schedule)
    b = _scheduler(tmp_path, "b", schedule)
    try:
        assert a.keeper.is_leader
        _run(a, clock, T0 + 75)  # the first slot and the first half of the second one's window
        a.close()  # releases the lease: b takes over at once, in the middle of the window
        _attempt(b)
        assert b.keeper.is_leader
        _run(b, clock, T0 + 150)
    finally:
        a.close()
        b.close()
    first = min(slot for _, slot, _, _ in sent)  # the grid's anchor: the first whole second after T0
    assert T0 < first <= T0 + 1
    expected = {
        (n, first + k * 60)
        for n in names
        for k in range(3)
        if first + k * 60 + jitter_offset(n, first + k * 60, 30) <= clock.now - STEP
    }
    assert {(e, s) for e, s, _, _ in sent} == expected
    assert len(sent) == len(expected)  # each slot once, whichever beat published it
    for entry, slot, published, _ in sent:
        offset = jitter_offset(entry, slot, 30.0)
        assert slot + offset <= published < slot + offset + STEP + 1e-6, (entry, slot, published - slot, offset)
    # the second slot was split between the two leaders, at the offsets the first would have used
    second = {epoch for _, slot, _, epoch in sent if slot == first + 60}
    assert second == {1, 2}


def test_slots_later_than_the_catch_up_window_are_skipped_and_counted(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, float, int]]
) -> None:
    schedule = {
        "windowed": {"task": "t.policies_noop", "schedule": 10.0, "catchup_window": 25,
                     "options": {"safe_time_misfire": "run_all"}},
        "plain": {"task": "t.policies_noop", "schedule": 10.0, "options": {"safe_time_misfire": "run_all"}},
    }  # fmt: skip
    counted: list[tuple[str, int]] = []

    def on_skipped(sender: Any, entry: str, count: int, **kw: Any) -> None:
        counted.append((entry, count))

    beat_slots_past_catchup.connect(on_skipped, weak=False)
    registry = CollectorRegistry()
    enable_metrics(registry)
    a = _scheduler(tmp_path, "a", schedule)
    try:
        _run(a, clock, T0 + 2)
        first = sent[0][1]
        assert {(e, s) for e, s, _, _ in sent} == {("windowed", first), ("plain", first)}
    finally:
        a.close()
    # every beat down for 100 s: the ten slots after the first were missed
    clock.now = first + 100.5
    del sent[:]
    b = _scheduler(tmp_path, "b", schedule)
    try:
        assert b.keeper.is_leader
        b.tick()
    finally:
        b.close()
        beat_slots_past_catchup.disconnect(on_skipped)
        disable_metrics()
    plain = sorted(s - first for e, s, _, _ in sent if e == "plain")
    windowed = sorted(s - first for e, s, _, _ in sent if e == "windowed")
    assert plain == [float(10 * k) for k in range(1, 11)]  # run_all: every missed slot
    assert windowed == [80.0, 90.0, 100.0]  # only the ones at most 25 s late
    assert counted == [("windowed", 7)]
    assert registry.get_sample_value("safe_time_beat_slots_past_catchup_total", {"entry": "windowed"}) == 7
