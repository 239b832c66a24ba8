"""``SafeDatabaseScheduler``: django-celery-beat's ``DatabaseScheduler`` with the Safe Beat lease.

The schedule stays in django-celery-beat's tables (admin, ``last_run_at``, ``total_run_count``
keep working); on top of it: one leader through the Redis lease, every slot published at most
once through the dispatch check, Redis ``TIME`` as "now", intervals on a fixed grid, and
``CrontabSchedule`` rows evaluated with the DST rules in their ``timezone``.
"""

from __future__ import annotations

import logging
import weakref
from datetime import datetime
from typing import Any

from celery import Celery
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedstate
from django.db import DatabaseError, InterfaceError
from django.db.models import F
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

from ... import constants as C
from ... import signals
from ...beat import history
from ...beat.base import LeasedScheduler, stop_signals_held, tick_granularity
from ...beat.leader import LeaseTerm
from ...beat.overlap import OverlapGate
from ...beat.policies import (
    OPTION_CATCHUP_WINDOW,
    OPTION_JITTER,
    OPTION_OVERLAP,
    OPTION_OVERLAP_TTL,
    beat_slots_past_catchup,
    jitter_offset,
    offset_function,
    overlap_option,
    seconds_option,
)
from ...beat.slots import OPTION_MISFIRE, GenericGrid, Grid, IntervalGrid, decide, grid_for
from ...clock import UTC, to_datetime
from ...exceptions import ScheduleError
from ...schedules import crontab

logger = logging.getLogger(__name__)

#: Per app, the rows found invalid and the reason last logged for each: django-celery-beat rebuilds
#: every row's entry on each schedule reload (several times a second while rows change), and an
#: invalid row is logged once per change of its reason, not once per rebuild.
_REFUSED: weakref.WeakKeyDictionary[Celery, dict[str, str]] = weakref.WeakKeyDictionary()


class SafeModelEntry(ModelEntry):
    """A ``ModelEntry`` on the scheduler's clock, with DST-correct crontabs and slot-based runs."""

    #: Set per scheduler (see ``SafeDatabaseScheduler.__init__``): Redis TIME as an aware datetime.
    clock: Any = None
    misfire: str = C.DEFAULT_MISFIRE
    on_time: float = C.DEFAULT_BEAT_LEASE
    grace: float | None = None

    #: a slot later than this many seconds is skipped whatever the policy (a row's headers set it)
    catchup_window: float | None = None
    #: each slot is published at a deterministic offset within this many seconds (a row's headers set it)
    jitter: float = 0.0

    def __init__(self, model: Any, app: Celery | None = None) -> None:
        # No last run: never fired, or disabled since (django-celery-beat empties it on disable, and
        # its admin's "enable" action is a bulk update that leaves date_changed as it was). Such a row
        # starts at its next slot: the slots since date_changed are not caught up.
        self.fresh = model.last_run_at is None and not model.start_time
        super().__init__(model, app=app)
        # A PeriodicTask has no options field: its headers JSON carries the per-row policies (the
        # admin can edit them), taken out so they are not published with the task's headers.
        headers = self.options.get("headers") or {}
        policy = headers.pop(OPTION_MISFIRE, None)
        if policy is not None:
            if policy not in C.MISFIRE_POLICIES:
                self._refuse(
                    f"headers.{OPTION_MISFIRE} must be one of {', '.join(sorted(C.MISFIRE_POLICIES))}, got {policy!r}"
                )
            self.misfire = policy
        window = headers.pop(OPTION_CATCHUP_WINDOW, None)
        if window is not None:
            try:
                self.catchup_window = seconds_option(
                    window, f"headers.{OPTION_CATCHUP_WINDOW}", self.name, zero_ok=False
                )
            except ScheduleError as exc:
                self._refuse(str(exc).removeprefix(f"entry {self.name!r}: "))
        # the overlap policy (and its run lease), read by the scheduler's overlap gate at publish
        self.overlap_options: dict[str, Any] = {}
        try:
            overlap = headers.pop(OPTION_OVERLAP, None)
            if overlap is not None:
                self.overlap_options[OPTION_OVERLAP] = overlap_option(overlap, self.name)
            ttl = headers.pop(OPTION_OVERLAP_TTL, None)
            if ttl is not None:
                self.overlap_options[OPTION_OVERLAP_TTL] = seconds_option(
                    ttl, f"headers.{OPTION_OVERLAP_TTL}", self.name, zero_ok=False
                )
        except ScheduleError as exc:
            self._refuse(str(exc).removeprefix(f"entry {self.name!r}: "))
        jitter = headers.pop(OPTION_JITTER, None)
        schedule = getattr(self, "schedule", None)
        if isinstance(schedule, celery_crontab) and getattr(model, "crontab", None) is not None:
            # the row's own timezone, with R1-R4 (django-celery-beat's TzAwareCrontab has no DST rules)
            self.schedule = crontab.from_celery(schedule, tz=model.crontab.timezone or "UTC")
        if jitter is not None:
            try:
                self.jitter = seconds_option(jitter, f"headers.{OPTION_JITTER}", self.name, zero_ok=True)
            except ScheduleError as exc:
                self._refuse(str(exc).removeprefix(f"entry {self.name!r}: "))
            grid = self.grid() if schedule is not None else None
            if isinstance(grid, IntervalGrid) and self.jitter >= grid.seconds:
                self._refuse(f"headers.{OPTION_JITTER} ({self.jitter:g} s) must be shorter than its interval")
            if isinstance(grid, GenericGrid):
                self._refuse(f"headers.{OPTION_JITTER} needs an interval or crontab schedule")
        if schedule is not None and self.clock is not None:
            self.schedule.nowfun = self.clock
        self.fire_slots: list[float] | None = None
        self.last_due: float | None = None
        # Valid (again): a later breakage is a change, logged anew.
        _REFUSED.get(self.app, {}).pop(self.name, None)

    def _refuse(self, reason: str) -> None:
        refused = _REFUSED.setdefault(self.app, {})
        if refused.get(self.name) != reason:
            refused[self.name] = reason
            logger.error("beat: entry %r is disabled: %s (the other entries keep firing)", self.name, reason)
        else:
            logger.debug("beat: entry %r is still disabled: %s", self.name, reason)
        raise ValueError(reason)  # DatabaseScheduler leaves out a row whose entry raises ValueError

    def _default_now(self) -> datetime:
        if self.clock is not None:
            now: datetime = self.clock().astimezone(self.app.timezone)
            return now
        return super()._default_now()  # type: ignore[no-any-return]

    def grid(self) -> Grid:
        return grid_for(self.schedule, self.app.timezone)

    def is_due(self) -> Any:
        state = super().is_due()
        if self.jitter <= 0 or not state.is_due:
            return state
        # Jitter only ever delays a slot: the stock check says its instant has come, and the slot
        # waits on until its offset, the same one in every beat (a hash of the row's name and slot).
        last = self.last_run_at
        slot = self.grid().next((last if last.tzinfo else last.replace(tzinfo=UTC)).timestamp())
        wait = slot + jitter_offset(self.name, slot, self.jitter) - self._default_now().timestamp()
        if wait > 0:
            return schedstate(False, wait)
        return state

    def __next__(self) -> SafeModelEntry:
        # last_run_at becomes the latest due slot, not "now": intervals stay on their grid
        # across leaders, and missed slots follow the misfire policy like SafeScheduler's.
        now = self._default_now().timestamp()
        grid = self.grid()
        last = self.last_run_at
        last_ts = (last if last.tzinfo else last.replace(tzinfo=UTC)).timestamp()
        expired = 0
        policy = "skip" if self.fresh else self.misfire
        if isinstance(grid, GenericGrid):
            fire, last_due, missed = [float(round(now))], float(round(now)), 0
        else:
            decision = decide(
                grid,
                grid.next(last_ts),
                now,
                policy=policy,
                on_time=self.on_time,
                grace=self.grace,
                offset=offset_function(self.name, self.jitter),
                window=self.catchup_window,
            )
            fire, last_due, missed, expired = decision.fire, decision.last_due, decision.missed, decision.expired
            if last_due <= last_ts:  # nothing was due after all (clock moved between checks)
                fire, last_due, missed, expired = [], last_ts, 0, 0
        if expired:
            logger.warning(
                "beat: entry %r skipped %d slot(s) up to %s: later than its catch-up window (%g s)",
                self.name,
                expired,
                to_datetime(last_due).isoformat(),
                self.catchup_window,
            )
            beat_slots_past_catchup.send(sender=type(self), entry=self.name, count=expired)  # an entry is unhashable
            missed -= expired
        if missed and self.fresh:
            logger.info(
                "beat: entry %r starts at its next slot (no last run: new, or enabled again); %d earlier slot(s) "
                "skipped",
                self.name,
                missed,
            )
        elif missed:
            logger.warning(
                "beat: entry %r missed %d slot(s) up to %s (misfire policy %s)",
                self.name,
                missed,
                to_datetime(last_due).isoformat(),
                policy,
            )
        self.fire_slots = fire
        self.last_due = last_due
        self.model.last_run_at = to_datetime(last_due)
        self.model.total_run_count += len(fire)
        self.model.no_changes = True
        return self.__class__(self.model)


class SafeDatabaseScheduler(LeasedScheduler, DatabaseScheduler):
    """``DatabaseScheduler`` that fires only while holding the Redis lease, each slot at most once."""

    _heap_invalidated: bool = False

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        self.init_lease(app)
        #: the rows' overlap policies (``safe_time_overlap`` in their headers JSON), decided at publish
        self.overlap_gate = OverlapGate(app, self.config)
        clock = self.clock
        self.Entry = type(
            "SafeModelEntry",
            (SafeModelEntry,),
            {
                "clock": staticmethod(lambda: to_datetime(clock.time())),
                "misfire": self.config.misfire,
                "on_time": self.config.beat_lease,
                "grace": self.config.misfire_grace,
            },
        )
        self._loaded: LeaseTerm | None = None
        self._heap_source: Any = None
        super().__init__(app, *args, **kwargs)

    def setup_schedule(self) -> None:
        self.check_startup(tick_granularity(self.max_interval or self.app.conf.beat_max_loop_interval or 300))
        super().setup_schedule()
        self.start_lease()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        with stop_signals_held():  # beat stops between ticks, never inside one (see stop_signals_held)
            return self._tick(*args, **kwargs)

    def _tick(self, *args: Any, **kwargs: Any) -> float:
        term = self.keeper.term
        if term is None:
            return self.granularity
        if self._loaded != term:
            # A new lease reads the tables afresh: last_run_at as the previous leader left it, and
            # edits that fired no signal. Keyed on the term, not the epoch: epochs restart after a
            # Redis reset, so a new lease can have an epoch number this beat had before.
            self._initial_read = True
            self._heap = None
            self._loaded = term
        try:
            interval = float(super().tick(*args, **kwargs))
        except (DatabaseError, InterfaceError) as exc:
            logger.error("beat: database error during tick: %s", exc)
            return self.granularity
        except self.backend_errors as exc:
            return self.backend_failed(exc)
        return min(interval, self.granularity)

    def schedules_equal(self, *args: Any, **kwargs: Any) -> bool:
        # The stock comparison walks every entry on every tick (45 ms at 10,000 tasks). The
        # schedule dict is replaced whenever the tables are re-read, so identity says enough.
        if getattr(self, "_heap_invalidated", False):
            self._heap_invalidated = False
            return False
        current = self._schedule
        same = current is not None and current is self._heap_source
        self._heap_source = current
        return same

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        """Publish ``entry``'s due slots that the dispatch check lets through (this leader, not fired yet)."""
        if advance:
            self.reserve(entry)
        epoch = self.keeper.epoch
        fire: list[float] | None = getattr(entry, "fire_slots", None)
        last_due: float | None = getattr(entry, "last_due", None)
        if epoch is None or fire is None or last_due is None:
            return None
        allowed = []
        for slot in fire:
            verdict = self.lease.dispatch_slot(epoch, entry.name, slot)
            when = to_datetime(slot)
            if verdict < 0:
                signals.beat_slot_duplicate.send(sender=self, entry=entry.name, slot=when, reason="not the leader")
                self.keeper.step_down("the dispatch check refused: another beat holds the lease")
                self._initial_read = True
                return None
            if verdict == 0:
                logger.warning("beat: entry %r slot %s was already fired; not publishing it again", entry.name, when)
                signals.beat_slot_duplicate.send(sender=self, entry=entry.name, slot=when, reason="already fired")
                continue
            allowed.append(slot)
        self._record_runs(entry, to_datetime(last_due), len(allowed))
        result = None
        for slot in allowed:
            result = self._publish(entry, slot, epoch, producer, **kwargs)
        return result

    def _publish(self, entry: Any, slot: float, epoch: int, producer: Any, **kwargs: Any) -> Any:
        when = to_datetime(slot)
        # its run record (one write: this scheduler's dispatch checks go one by one) names the task id
        task_id = history.record_published(self.backend, entry.name, slot, epoch, "beat").get((entry.name, slot))
        extra = self.overlap_gate.admit(entry.name, getattr(entry, "overlap_options", None), slot, task_id=task_id)
        if extra is None:  # dropped by its overlap policy (logged and signalled)
            history.dropped(self.backend, entry.name, slot, self.clock.time())
            return None
        original = entry.options
        headers = {
            **(original.get("headers") or {}),
            **extra.pop("headers", {}),
            C.HEADER_SLOT: when.isoformat(),
            C.HEADER_EPOCH: epoch,
            C.HEADER_ENTRY: entry.name,
        }
        entry.options = {**original, **extra, "headers": headers}  # ModelEntry cannot be copied
        if task_id is not None:
            entry.options["task_id"] = task_id
        try:
            result = super().apply_async(entry, producer=producer, advance=False, **kwargs)
        except Exception as exc:
            history.not_published(self.backend, entry.name, slot, self.clock.time(), exc)
            raise
        finally:
            entry.options = original
        signals.beat_slot_dispatched.send(
            sender=self, entry=entry.name, slot=when, epoch=epoch, task_id=getattr(result, "id", None)
        )
        return result

    def _record_runs(self, entry: Any, last_due: datetime, published: int) -> None:
        # Written at once (not at the next sync) so a new leader reads where this one stopped;
        # a queryset update fires no signal, so it does not make every beat reload the table.
        self.Model.objects.filter(pk=entry.model.pk).update(
            last_run_at=last_due, total_run_count=F("total_run_count") + published
        )
        self._dirty.discard(entry.name)

    def sync(self) -> None:
        # last_run_at/total_run_count are written per run; a standby must never write stale ones
        self._dirty.clear()


def invalid_rows(app: Celery) -> dict[str, str]:
    """Enabled django-celery-beat row name -> why ``SafeDatabaseScheduler`` leaves it out, checked as
    it builds each row's entry, without logging (``safe-time check`` and ``beat list`` show them)."""
    from django_celery_beat.models import PeriodicTask

    problems: dict[str, str] = {}
    # Neither logged nor remembered as logged: a leader in this process still says each one once.
    quiet, logger.disabled = logger.disabled, True
    refused = dict(_REFUSED.get(app, {}))
    try:
        for model in PeriodicTask.objects.filter(enabled=True).order_by("name"):
            try:
                SafeModelEntry(model, app=app)
            except Exception as exc:  # a row django-celery-beat or this scheduler cannot build
                problems[model.name] = str(exc) or exc.__class__.__name__
    finally:
        logger.disabled = quiet
        _REFUSED[app] = refused
    return problems
