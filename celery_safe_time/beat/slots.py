"""Slot grids, entry plans and misfire decisions for beat entries: pure logic, time passed in.

A *slot* is the instant an entry is scheduled for (UNIX seconds, UTC): the cron instant, or
for an interval the previous slot plus the interval (a fixed grid anchored at the entry's
first run). It names a run, so the dispatch script can publish each one at most once.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import deque
from datetime import datetime, timedelta, tzinfo
from typing import Any, Protocol

from celery.schedules import BaseSchedule, schedstate
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_interval
from dateutil.rrule import rrule as dateutil_rrule

from .. import constants as C
from ..clock import UTC, to_datetime
from ..config import SafeTimeConfig
from ..exceptions import ImproperlyConfigured, SafeTimeError, ScheduleError
from ..schedules import crontab
from .state import dump_state, state_next

#: Per-entry misfire policy: ``options={"safe_time_misfire": ...}`` (headers JSON on django-celery-beat rows).
OPTION_MISFIRE = "safe_time_misfire"


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


#: The "next slot" of a schedule that has no more: never due (a zset score Redis accepts).
NEVER = math.inf


class at(BaseSchedule):  # a schedule, named like celery's ``crontab`` and ``solar``
    """A one-off schedule: fires once at ``when`` (an aware datetime; naive means UTC), then never."""

    def __init__(self, when: datetime, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(when, datetime):
            raise ScheduleError(f"at: expected a datetime, got {when!r}")
        self.when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)

    @property
    def ts(self) -> float:
        return self.when.timestamp()

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        now: datetime = self.now()
        return self.when - now

    def is_due(self, last_run_at: datetime) -> schedstate:
        # the scheduler uses the grid; this keeps the celery protocol for other callers
        return schedstate(False, max(0.0, self.remaining_estimate(last_run_at).total_seconds()))

    def __repr__(self) -> str:
        return f"<at {self.when.isoformat()}>"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, at) and other.ts == self.ts

    def __hash__(self) -> int:
        return hash(self.ts)


class rrule(BaseSchedule):  # named like redbeat's rrule schedule
    """A ``dateutil.rrule.rrule`` as a celery schedule (redbeat has one too). A naive ``dtstart``
    means UTC; an aware one keeps its zone (occurrences follow dateutil's wall-clock rules)."""

    def __init__(self, rule: dateutil_rrule, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(rule, dateutil_rrule):
            raise ScheduleError(f"rrule: expected a dateutil.rrule.rrule, got {rule!r}")
        self.rule = rule

    def next_ts(self, after: float) -> float:
        start = self.rule._dtstart
        moment = datetime.fromtimestamp(after, UTC)
        if start is None or start.tzinfo is None:
            moment = moment.replace(tzinfo=None)
        found = self.rule.after(moment, inc=False)
        if found is None:
            return NEVER
        if found.tzinfo is None:
            found = found.replace(tzinfo=UTC)
        return float(found.timestamp())

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        now: datetime = self.now()
        return to_datetime(self.next_ts(last_run_at.timestamp())) - now

    def is_due(self, last_run_at: datetime) -> schedstate:
        return schedstate(False, max(0.0, self.remaining_estimate(last_run_at).total_seconds()))

    def __repr__(self) -> str:
        return f"<rrule {str(self.rule).replace(chr(10), ' ')} tz={getattr(self.rule._dtstart, 'tzinfo', None)}>"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, rrule) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


@dataclasses.dataclass(frozen=True)
class OneOffGrid:
    """One slot at ``at``: first(now) is that instant even when it passed (the misfire policy
    decides whether a late one-off still runs); after it, nothing."""

    at: float

    def first(self, now: float) -> float:
        return self.at

    def next(self, slot: float) -> float:
        return self.at if slot < self.at else NEVER

    def signature(self) -> str:
        return f"at {self.at!r}"


@dataclasses.dataclass(frozen=True)
class RRuleGrid:
    schedule: rrule

    def first(self, now: float) -> float:
        return self.schedule.next_ts(now)

    def next(self, slot: float) -> float:
        return self.schedule.next_ts(slot)

    def signature(self) -> str:
        return repr(self.schedule)


def grid_for(schedule: Any, default_tz: tzinfo) -> Grid:
    """The slot grid of a celery schedule; plain crontabs get the DST rules in the app timezone."""
    if isinstance(schedule, at):
        return OneOffGrid(schedule.ts)
    if isinstance(schedule, rrule):
        return RRuleGrid(schedule)
    if isinstance(getattr(schedule, "rrule", None), dateutil_rrule):  # redbeat.schedules.rrule
        return RRuleGrid(rrule(schedule.rrule))
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
        if due > now:  # also a schedule with no more slots (NEVER)
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the scheduler needs to fire one entry."""

    grid: Grid
    policy: str

    @functools.cached_property
    def signature(self) -> str:
        """The grid's signature, computed once (a crontab's repr is costly and 100,000 entries share a few)."""
        return self.grid.signature()


def entry_plan(entry: Any, config: SafeTimeConfig, app: Any) -> Plan:
    """Validate one entry; raises :class:`SafeTimeError` with a message naming the problem."""
    policy = (entry.options or {}).get(OPTION_MISFIRE, config.misfire)
    if policy not in C.MISFIRE_POLICIES:
        raise ImproperlyConfigured(
            f"options.{OPTION_MISFIRE}", f"must be one of {', '.join(sorted(C.MISFIRE_POLICIES))}, got {policy!r}"
        )
    if entry.task not in app.tasks:
        raise SafeTimeError(f"unknown task {entry.task!r} (not registered in this app)")
    return Plan(grid=grid_for(entry.schedule, app.timezone), policy=policy)


def next_state(
    plan: Plan, state: dict[str, Any], score: float | None, now: float, firsts: dict[str, float] | None = None
) -> tuple[str, float] | None:
    """An entry's state JSON to write when (re)planning it and its next slot, None when its state
    stands as it is.

    An unchanged grid keeps its last and next slot (a resumed entry continues where it paused;
    a next slot in the past is then a misfire, handled by its policy); an edited grid continues
    after the last fired slot; a new entry starts at its first slot from ``now``. ``firsts`` shares
    the first slot between entries of one grid signature planned together.
    """
    sig = plan.signature
    if state and state.get("sig") == sig and score is not None:
        return None
    last = state.get("last") if state else None
    if state and state.get("sig") == sig:
        next_fire = state_next(state)
    elif not state and score is not None:
        # the state was lost but the due set was not: keep the entry's place on its grid
        next_fire = score
    elif last is not None:  # edited: the new grid continues after the last fired slot
        next_fire = plan.grid.next(float(last))
    elif firsts is None:
        next_fire = plan.grid.first(now)
    else:
        if sig not in firsts:
            firsts[sig] = plan.grid.first(now)
        next_fire = firsts[sig]
    return dump_state(last, next_fire, sig), next_fire
