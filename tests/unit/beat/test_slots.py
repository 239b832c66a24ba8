"""Slot grids and misfire decisions (pure; time passed in)."""

from __future__ import annotations

import datetime as dt

import pytest
from celery.schedules import crontab as plain_crontab
from celery.schedules import schedule as interval

from celery_safe_time import crontab
from celery_safe_time.beat.slots import CronGrid, IntervalGrid, Plan, decide, grid_for
from celery_safe_time.exceptions import ScheduleError

UTC = dt.timezone.utc
GRID = IntervalGrid(10.0)


def test_on_time_slot_fires_under_every_policy() -> None:
    for policy in ("run_once", "skip", "run_all"):
        d = decide(GRID, 100.0, 101.0, policy=policy, on_time=6, grace=None)
        assert d.fire == [100.0]
        assert d.next == 110.0
        assert d.missed == 0


@pytest.mark.parametrize(("policy", "fired"), [("run_once", [130.0]), ("skip", []), ("run_all", [110.0, 120.0, 130.0])])
def test_three_missed_slots(policy: str, fired: list[float]) -> None:
    d = decide(GRID, 110.0, 137.0, policy=policy, on_time=6, grace=None)
    assert d.fire == fired
    assert d.last_due == 130.0
    assert d.next == 140.0
    assert d.missed == 3 - len(fired)


def test_on_time_slot_counts_as_the_catch_up() -> None:
    d = decide(GRID, 110.0, 132.0, policy="run_once", on_time=6, grace=None)
    assert d.fire == [130.0]  # S1, S2 missed; S3 on time is the one run


def test_run_all_is_capped_and_grace_drops_old_slots() -> None:
    d = decide(IntervalGrid(1.0), 0.0, 1000.5, policy="run_all", on_time=0.1, grace=None, cap=5)
    assert d.fire == [996.0, 997.0, 998.0, 999.0, 1000.0]
    d = decide(GRID, 110.0, 137.0, policy="run_all", on_time=1, grace=20)
    assert d.fire == [120.0, 130.0]


def test_unknown_policy() -> None:
    with pytest.raises(ScheduleError):
        decide(GRID, 0.0, 1.0, policy="sometimes", on_time=1, grace=None)


def test_grids() -> None:
    assert isinstance(grid_for(interval(dt.timedelta(seconds=5)), UTC), IntervalGrid)
    assert grid_for(7.5, UTC) == IntervalGrid(7.5)
    ny = grid_for(plain_crontab("30", "2"), dt.timezone.utc)
    assert isinstance(ny, CronGrid)
    berlin = grid_for(crontab("30", "2", tz="Europe/Berlin"), UTC)
    assert berlin.signature() != ny.signature()
    with pytest.raises(ScheduleError):
        grid_for("every tuesday", UTC)
    assert GRID.first(100.2) == 101.0


def test_a_never_firing_rrule_is_walked_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import datetime

    from dateutil.rrule import rrulestr

    from celery_safe_time.beat import slots
    from celery_safe_time.beat.slots import NEVER, rrule

    text = "RRULE:FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=30"  # no 30 February: never fires
    start = datetime(2026, 1, 1)  # naive: UTC
    assert rrule(rrulestr(text, dtstart=start)).next_ts(1_800_000_000.0) == NEVER
    walks: list[datetime] = []
    again = rrule(rrulestr(text, dtstart=start))  # as every list_entries builds it from its JSON

    def walk(rule: object, moment: datetime, probes: object = None) -> None:
        walks.append(moment)

    monkeypatch.setattr(slots, "bounded_after", walk)
    assert again.next_ts(1_800_000_100.0) == NEVER
    assert walks == []
    assert again.next_ts(1_700_000_000.0) == NEVER  # earlier than what was walked: asked again
    assert len(walks) == 1


class _CountingGrid(IntervalGrid):
    """An interval grid that counts its ``next`` calls (how often a decision walks it)."""

    calls = 0

    def next(self, after: float) -> float:
        self.calls += 1
        return super().next(after)


def test_a_plan_without_jitter_decides_a_burst_once_for_every_entry() -> None:
    grid = _CountingGrid(10.0)
    plan = Plan(grid=grid, policy="run_once")
    decisions = [plan.decide(f"tenant-{i}", 100.0, 101.0, on_time=6, grace=None) for i in range(1000)]
    assert grid.calls == 1  # the 1,000 entries due at the same slot and instant share one walk
    assert all(d == decide(GRID, 100.0, 101.0, policy="run_once", on_time=6, grace=None) for d in decisions)
    # another slot, instant, policy or on-time bound is decided afresh
    assert plan.decide("tenant-0", 100.0, 125.0, on_time=6, grace=None).fire == [120.0]
    assert plan.decide("tenant-0", 100.0, 125.0, on_time=6, grace=None, policy="run_all").fire == [100.0, 110.0, 120.0]
    assert plan.decide("tenant-0", 100.0, 125.0, on_time=30, grace=None).fire == [100.0, 110.0, 120.0]
    assert plan.decide("tenant-0", 110.0, 125.0, on_time=6, grace=None).fire == [120.0]


def test_a_jittered_plan_decides_each_entry_on_its_own_offset() -> None:
    plan = Plan(grid=IntervalGrid(60.0), policy="run_once", jitter=30.0)
    fired = {plan.decide(f"tenant-{i}", 60.0, 75.0, on_time=6, grace=None).fire == [60.0] for i in range(50)}
    assert fired == {True, False}  # some entries' offsets are past 75 s, some are not
