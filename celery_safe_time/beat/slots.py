"""Slot grids and misfire decisions for beat entries: pure logic, time passed in.

A *slot* is the instant an entry is scheduled for (UNIX seconds, UTC): the cron instant, or
for an interval the previous slot plus the interval (a fixed grid anchored at the entry's
first run). It names a run, so the dispatch script can publish each one at most once.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from datetime import timedelta, tzinfo
from typing import Any, Protocol

from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_interval

from .. import constants as C
from ..clock import to_datetime
from ..exceptions import ScheduleError
from ..schedules import crontab


class Grid(Protocol):
    def first(self, now: float) -> float:
        """The first slot of a new entry seen at ``now``."""

    def next(self, slot: float) -> float:
        """The slot after ``slot``."""

    def signature(self) -> str:
        """Changes when the grid changes (a schedule edit)."""


@dataclasses.dataclass(frozen=True)
class IntervalGrid:
    seconds: float

    def first(self, now: float) -> float:
        return float(math.ceil(now))

    def next(self, slot: float) -> float:
        return slot + self.seconds

    def signature(self) -> str:
        return f"every {self.seconds:g}s"


@dataclasses.dataclass(frozen=True)
class CronGrid:
    cron: crontab

    def first(self, now: float) -> float:
        return self.cron.next_ts(now)

    def next(self, slot: float) -> float:
        return self.cron.next_ts(slot)

    def signature(self) -> str:
        return repr(self.cron) + f" tz={self.cron.tz}"


@dataclasses.dataclass(frozen=True)
class GenericGrid:
    """Any other celery schedule (solar, custom): asks it how long after a slot the next one is."""

    schedule: Any

    def first(self, now: float) -> float:
        return self.next(now)

    def next(self, slot: float) -> float:
        probe = copy.copy(self.schedule)
        probe.nowfun = lambda: to_datetime(slot)
        remaining = probe.remaining_estimate(to_datetime(slot))
        return slot + max(1.0, float(remaining.total_seconds()))

    def signature(self) -> str:
        return repr(self.schedule)


def grid_for(schedule: Any, default_tz: tzinfo) -> Grid:
    """The slot grid of a celery schedule; plain crontabs get the DST rules in the app timezone."""
    if isinstance(schedule, crontab):
        return CronGrid(schedule)
    if isinstance(schedule, celery_crontab):
        return CronGrid(crontab.from_celery(schedule, tz=default_tz))
    if isinstance(schedule, celery_interval):
        seconds = schedule.run_every.total_seconds()
        if seconds <= 0:
            raise ScheduleError(f"interval must be positive, got {schedule.run_every}")
        return IntervalGrid(seconds)
    if isinstance(schedule, (int, float, timedelta)):
        seconds = schedule.total_seconds() if isinstance(schedule, timedelta) else float(schedule)
        return IntervalGrid(seconds)
    if hasattr(schedule, "remaining_estimate"):
        return GenericGrid(schedule)
    raise ScheduleError(f"unsupported schedule {schedule!r}")


@dataclasses.dataclass(frozen=True)
class Decision:
    fire: list[float]  # slots to publish, ascending
    last_due: float  # the latest slot that was due (fired or not)
    next: float  # the entry's next slot
    missed: int  # due slots that were late and not published


def decide(
    grid: Grid, slot: float, now: float, *, policy: str, on_time: float, grace: float | None, cap: int = C.RUN_ALL_CAP
) -> Decision:
    """Which of the due slots from ``slot`` up to ``now`` to publish.

    A slot at most ``on_time`` seconds old is on time and always published. Older ones were
    missed (every beat was down or stalled) and follow ``policy``: ``run_once`` publishes the
    latest missed slot when nothing on time was published, ``run_all`` publishes every missed
    slot (the latest ``cap``), ``skip`` none. A missed slot older than ``grace`` is never published.
    """
    if policy not in C.MISFIRE_POLICIES:
        raise ScheduleError(f"unknown misfire policy {policy!r}")
    recent_missed: deque[float] = deque(maxlen=max(1, cap))
    on_time_slots: list[float] = []
    due = slot
    last_due = slot
    total_due = 0
    for _ in range(C.BEAT_CATCHUP_SCAN_LIMIT):
        if due > now:
            break
        last_due = due
        total_due += 1
        if now - due <= on_time:
            on_time_slots.append(due)
        elif grace is None or now - due <= grace:
            recent_missed.append(due)
        due = grid.next(due)
    else:  # down for ages on a fine grid: resume from now
        due = grid.first(now)
    missed = list(recent_missed)
    fire: list[float] = []
    if policy == "run_all":
        fire = missed
    elif policy == "run_once" and missed and not on_time_slots:
        fire = missed[-1:]
    fire = sorted(fire + on_time_slots)
    return Decision(fire=fire, last_due=last_due, next=due, missed=max(0, total_due - len(fire)))
