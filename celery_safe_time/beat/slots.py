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
import threading
from collections import deque
from collections.abc import Callable
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
from .policies import jitter_offset, offset_function, policies_of, unjitter
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


#: rrule (text, dtstart) -> a time after which it has no occurrence. Finding "none" walks every period
#: of the search horizon (``RRULE_SEARCH_YEARS``: 0.3 s of CPU for ``FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30``);
#: the answer holds for every later time, so each process pays that walk once per rule, not on every
#: ``list_entries`` (``status``, the admin). Bounded: the oldest answers are dropped first.
_RRULE_ENDED: dict[tuple[str, str], float] = {}
_RRULE_ENDED_SIZE = 1024
_RRULE_ENDED_LOCK = threading.Lock()


def _remember_ended(rule_id: tuple[str, str], after: float) -> None:
    with _RRULE_ENDED_LOCK:
        known = _RRULE_ENDED.get(rule_id)
        if known is None and len(_RRULE_ENDED) >= _RRULE_ENDED_SIZE:
            _RRULE_ENDED.pop(next(iter(_RRULE_ENDED)))
        _RRULE_ENDED[rule_id] = after if known is None else min(known, after)


def _moved(moment: datetime, years: int) -> datetime:
    """``moment`` with its wall-clock year moved (``years`` is a whole number of Gregorian cycles, so
    February 29 stays a date)."""
    return moment.replace(year=moment.year + years)


def bounded_after(
    rule: dateutil_rrule, moment: datetime, probes: dict[int, dateutil_rrule] | None = None
) -> datetime | None:
    """``rule.after(moment)``, searching at most about ``RRULE_SEARCH_YEARS`` (plus one cycle) past
    ``moment`` (or past the rule's start, when later); None when no occurrence is left.

    dateutil stops a search with no occurrence only at the year 9999, so the rule is searched moved
    forward by whole Gregorian cycles (same calendar, so the same occurrences, moved) to end there
    ``RRULE_SEARCH_YEARS`` to one cycle more after ``moment``. ``moment`` is naive or aware as the
    rule's ``dtstart`` is. ``probes`` keeps the moved rules between calls (one per move).
    """
    start: datetime = rule._dtstart
    if rule._byeaster is not None:  # Easter does not repeat with the calendar: dateutil's own search
        return rule.after(moment, inc=False)  # type: ignore[no-any-return]
    cycle = C.GREGORIAN_CYCLE_YEARS
    room = datetime.max.year - max(moment.year, start.year) - C.RRULE_SEARCH_YEARS
    years = max(0, room // cycle * cycle)
    if years == 0:  # already within the horizon of dateutil's last year
        return rule.after(moment, inc=False)  # type: ignore[no-any-return]
    probe = None if probes is None else probes.get(years)
    if probe is None:
        until: datetime | None = rule._until
        # An end past the moved search's last year cannot cut it: left out.
        moved_until = None if until is None or until.year + years > datetime.max.year else _moved(until, years)
        probe = rule.replace(dtstart=_moved(start, years), until=moved_until)
        if probes is not None:
            probes.clear()  # the move changes once in 400 years of searching: keep the current one
            probes[years] = probe
    found: datetime | None = probe.after(_moved(moment, years), inc=False)
    return None if found is None else _moved(found, -years)


class rrule(BaseSchedule):  # named like redbeat's rrule schedule
    """A ``dateutil.rrule.rrule`` as a celery schedule (redbeat has one too). A naive ``dtstart``
    means UTC; an aware one keeps its zone (occurrences follow dateutil's wall-clock rules). The
    search for the next occurrence is bounded (:func:`bounded_after`)."""

    def __init__(self, rule: dateutil_rrule, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(rule, dateutil_rrule):
            raise ScheduleError(f"rrule: expected a dateutil.rrule.rrule, got {rule!r}")
        self.rule = rule
        self._probes: dict[int, dateutil_rrule] = {}

    def next_ts(self, after: float) -> float:
        start = self.rule._dtstart
        rule_id = (str(self.rule), repr(start))
        ended = _RRULE_ENDED.get(rule_id)
        if ended is not None and after >= ended:
            return NEVER
        moment = datetime.fromtimestamp(after, UTC)
        if start is None or start.tzinfo is None:
            moment = moment.replace(tzinfo=None)
        else:  # the rule's own zone: the search moves wall-clock years
            moment = moment.astimezone(start.tzinfo)
        found = bounded_after(self.rule, moment, self._probes)
        if found is None:
            _remember_ended(rule_id, after)
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
    expired: int = 0  # of those, the slots later than the catch-up window


def decide(
    grid: Grid,
    slot: float,
    now: float,
    *,
    policy: str,
    on_time: float,
    grace: float | None,
    cap: int = C.RUN_ALL_CAP,
    offset: Callable[[float], float] | None = None,
    window: float | None = None,
) -> Decision:
    """Which of the due slots from ``slot`` up to ``now`` to publish.

    A slot is due at its instant plus its jitter ``offset`` (none: at its instant); its lateness is
    counted from there. A slot at most ``on_time`` seconds late is on time and published. Later ones
    were missed (every beat was down or stalled) and follow ``policy``: ``run_once`` publishes the
    latest missed slot when nothing on time was published, ``run_all`` publishes every missed slot
    (the latest ``cap``), ``skip`` none. A missed slot older than ``grace`` is never published, nor
    is any slot later than the entry's catch-up ``window`` (counted in ``expired``).
    """
    if policy not in C.MISFIRE_POLICIES:
        raise ScheduleError(f"unknown misfire policy {policy!r}")
    recent_missed: deque[float] = deque(maxlen=max(1, cap))
    on_time_slots: list[float] = []
    due = slot
    last_due = slot
    total_due = 0
    expired = 0
    for _ in range(C.BEAT_CATCHUP_SCAN_LIMIT):
        late = now - (due if offset is None or due == NEVER else due + offset(due))
        if late < 0:  # also a schedule with no more slots (NEVER)
            break
        last_due = due
        total_due += 1
        if window is not None and late > window:
            expired += 1
        elif late <= on_time:
            on_time_slots.append(due)
        elif grace is None or late <= grace:
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
    return Decision(fire=fire, last_due=last_due, next=due, missed=max(0, total_due - len(fire)), expired=expired)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the scheduler needs to fire one entry (shared by the entries of one schedule and policies)."""

    grid: Grid
    policy: str
    #: seconds within which each slot is published (0: at its instant); see :mod:`.policies`
    jitter: float = 0.0
    #: a slot later than this many seconds is skipped whatever the policy (None: no window)
    catchup_window: float | None = None

    @functools.cached_property
    def signature(self) -> str:
        """The grid's signature, computed once (a crontab's repr is costly and 100,000 entries share a few)."""
        return self.grid.signature()

    def due_at(self, name: str, slot: float) -> float:
        """When the entry ``name`` publishes ``slot``: its instant plus its jitter offset (its due score)."""
        if self.jitter <= 0 or not math.isfinite(slot):
            return slot
        return slot + jitter_offset(name, slot, self.jitter)

    def slot_at(self, name: str, due: float) -> float:
        """The slot of a due score (see :func:`.policies.unjitter`: only when the state is lost)."""
        return unjitter(name, due, self.jitter, self._candidates)

    def _candidates(self, low: float, high: float) -> list[float]:
        if isinstance(self.grid, IntervalGrid):  # the grid's anchor is in the lost state: whole seconds
            return [float(s) for s in range(math.floor(low) + 1, math.floor(high) + 1)]
        out: list[float] = []
        slot = self.grid.next(low)
        while slot <= high and len(out) < C.BEAT_CATCHUP_SCAN_LIMIT:
            out.append(slot)
            slot = self.grid.next(slot)
        return out

    def decide(
        self, name: str, slot: float, now: float, *, on_time: float, grace: float | None, policy: str | None = None
    ) -> Decision:
        """:func:`decide` for the entry ``name`` with this plan's grid, jitter and catch-up window.

        Without jitter the decision does not depend on the entry: the last one is kept and given again
        for the same slot and instant, so the entries of a burst (100,000 tenants due at the same 09:00,
        one plan, one tick's ``now``) walk the grid once, not once each.
        """
        policy = self.policy if policy is None else policy
        offset = offset_function(name, self.jitter)  # None without jitter
        key = (slot, now, policy, on_time, grace)
        last = self.__dict__.get("_last_decision")
        if offset is None and last is not None and last[0] == key:
            return last[1]  # type: ignore[no-any-return]
        made = decide(
            self.grid, slot, now, policy=policy, on_time=on_time, grace=grace, offset=offset, window=self.catchup_window
        )
        if offset is None:
            # a frozen dataclass: the cache goes in the instance dict, as a cached_property's value does
            self.__dict__["_last_decision"] = (key, made)
        return made


def entry_plan(entry: Any, config: SafeTimeConfig, app: Any) -> Plan:
    """Validate one entry; raises :class:`SafeTimeError` with a message naming the problem."""
    options = entry.options or {}
    policy = options.get(OPTION_MISFIRE, config.misfire)
    if policy not in C.MISFIRE_POLICIES:
        raise ImproperlyConfigured(
            f"options.{OPTION_MISFIRE}", f"must be one of {', '.join(sorted(C.MISFIRE_POLICIES))}, got {policy!r}"
        )
    policies = policies_of(options, entry.name)
    if entry.task not in app.tasks:
        raise SafeTimeError(f"unknown task {entry.task!r} (not registered in this app)")
    grid = grid_for(entry.schedule, app.timezone)
    if isinstance(grid, IntervalGrid) and policies.jitter >= grid.seconds:
        raise ScheduleError(
            f"entry {entry.name!r}: safe_time_jitter ({policies.jitter:g} s) must be shorter than its "
            f"interval ({grid.seconds:g} s)"
        )
    return Plan(grid=grid, policy=policy, jitter=policies.jitter, catchup_window=policies.catchup_window)


def next_state(
    plan: Plan,
    state: dict[str, Any],
    score: float | None,
    now: float,
    firsts: dict[str, float] | None = None,
    *,
    name: str = "",
    resumed: bool = False,
) -> tuple[str, float] | None:
    """An entry's state JSON to write when (re)planning the entry ``name`` and its due score (its
    next slot plus its jitter offset), None when its state stands as it is.

    An unchanged grid keeps its last and next slot (a next slot in the past is then a misfire,
    handled by its policy), and moves the due score when the jitter changed; an edited grid continues
    after the last fired slot; a new entry starts at its first slot from ``now``. A ``resumed``
    entry (out of the due set while paused) continues its grid at its first slot not yet due: the
    slots that fell during the pause are skipped, never caught up. ``firsts`` shares the first slot
    between entries of one grid signature planned together.
    """
    sig = plan.signature
    if state and state.get("sig") == sig and score is not None:
        slot = state_next(state)
        due = plan.due_at(name, slot)
        if not (math.isfinite(due) and math.isfinite(score)) or abs(due - score) < _SAME_DUE:
            return None
        return dump_state(state.get("last"), slot, sig), due  # the jitter changed: same slot, new instant
    last = state.get("last") if state else None
    if state and state.get("sig") == sig:
        next_fire = state_next(state)
        if resumed and not isinstance(plan.grid, OneOffGrid) and plan.due_at(name, next_fire) <= now:
            skipped = plan.decide(name, next_fire, now, on_time=0.0, grace=None, policy="skip")
            return dump_state(skipped.last_due, skipped.next, sig), plan.due_at(name, skipped.next)
    elif not state and score is not None:
        # the state was lost but the due set was not: keep the entry's place on its grid
        next_fire = plan.slot_at(name, score)
    elif last is not None:  # edited: the new grid continues after the last fired slot
        next_fire = plan.grid.next(float(last))
    elif firsts is None:
        next_fire = plan.grid.first(now)
    else:
        if sig not in firsts:
            firsts[sig] = plan.grid.first(now)
        next_fire = firsts[sig]
    return dump_state(last, next_fire, sig), plan.due_at(name, next_fire)


#: Two due scores closer than this are the same (scores are whole milliseconds of a slot plus an offset).
_SAME_DUE = 0.0015
