"""``SafeDatabaseScheduler``: django-celery-beat's ``DatabaseScheduler`` with the Safe Beat lease.

The schedule stays in django-celery-beat's tables (admin, ``last_run_at``, ``total_run_count``
keep working); on top of it: one leader through the Redis lease, every slot published at most
once through the dispatch check, Redis ``TIME`` as "now", intervals on a fixed grid, and
``CrontabSchedule`` rows evaluated with the DST rules in their ``timezone``.
"""

from __future__ import annotations

import heapq
import logging
import time
import weakref
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from celery import Celery
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedstate
from django.conf import settings
from django.db import DatabaseError, InterfaceError, close_old_connections, connections, router, transaction
from django.db.models import F
from django.db.models.expressions import RawSQL
from django.utils import timezone as django_timezone
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

from ... import constants as C
from ... import signals
from ...beat import history
from ...beat.base import LeasedScheduler, tick_granularity
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
        # the catch-up window, and the overlap policy and its run lease (read by the overlap gate at publish)
        self.overlap_options: dict[str, Any] = {}
        try:
            window = headers.pop(OPTION_CATCHUP_WINDOW, None)
            if window is not None:
                self.catchup_window = seconds_option(
                    window, f"headers.{OPTION_CATCHUP_WINDOW}", self.name, zero_ok=False
                )
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


#: The columns the due index reads per row: enough to place the row on its grid, not to fire it.
_INDEX_COLUMNS = (
    "id",
    "enabled",
    "interval_id",
    "crontab_id",
    "solar_id",
    "clocked_id",
    "last_run_at",
    "start_time",
    "date_changed",
)
#: the schedule foreign keys of a row, in the order django-celery-beat's ``PeriodicTask.scheduler`` reads them
_KINDS = ("interval", "crontab", "solar", "clocked")
#: rows fetched per round trip while the index is read
_CHUNK = 5000
#: how often (seconds) a tick reads django-celery-beat's change marker (PeriodicTasks.last_update)
_POLL = 0.5
#: a saved row's ``date_changed`` is its writer's clock at save time, committed later: rows changed
#: this long before the newest one seen are read again, and the ones already applied are skipped
_CHANGE_SLACK = 60.0
#: the whole index is read again this often (seconds) with no change marked, like django-celery-beat's
#: own forced sync: it catches what no change marker reports (a bulk enable, an edit that fired no signal)
_RECONCILE = 300.0


class SafeDatabaseScheduler(LeasedScheduler, DatabaseScheduler):
    """``DatabaseScheduler`` that fires only while holding the Redis lease, each slot at most once.

    It keeps a due index, not the table's entries: each enabled row's earliest due time in a heap,
    read from a few columns when a lease starts. A row is built into an entry only when it comes
    due, from the row as it is then; a saved row is read again alone (``date_changed`` after the
    newest one seen) when django-celery-beat's change marker moves.
    """

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
        #: row id -> its due time in the heap; a heap item whose time differs is stale and skipped
        self._due: dict[int, float] = {}
        self._due_heap: list[tuple[float, int]] = []
        #: row id -> its date_changed (POSIX seconds) as last applied (enabled or not)
        self._versions: dict[int, float | None] = {}
        self._seen: float | None = None  # the newest date_changed applied
        self._mark: datetime | None = None  # django-celery-beat's change marker as last read
        self._next_poll = 0.0
        self._reconcile_at = 0.0
        #: (kind, schedule row id) -> its grid (None: evaluated by the entry at due time)
        self._grids: dict[tuple[str, int], Grid | None] = {}
        #: (kind, schedule row id, last run) -> the next slot on that grid
        self._next_slots: dict[tuple[str, int, float], float] = {}
        #: index reads: how many times the whole index was read (tests and the benchmark count them)
        self.index_reads = 0
        super().__init__(app, *args, **kwargs)

    def setup_schedule(self) -> None:
        self.check_startup(tick_granularity(self.max_interval or self.app.conf.beat_max_loop_interval or 300))
        # The beat_schedule entries (and celery's cleanup entry) are written as rows; the rows are
        # not read into entries here: a lease reads the due index at its first tick.
        self._initial_read = False
        self._schedule: dict[str, Any] = {}
        self.install_default_entries(self._schedule)
        self.update_from_dict(self.app.conf.beat_schedule)
        self._schedule = {}  # the rows are fired from the index, built afresh when due
        self.start_lease()

    @property
    def schedule(self) -> dict[str, Any]:
        """Entries built by this process outside the index (``update_from_dict``); the rows it fires
        are in the due index."""
        if self._schedule is None:
            self._schedule = {}
        schedule: dict[str, Any] = self._schedule
        return schedule

    def _tick(self) -> float:
        term = self.keeper.term
        if term is None:
            return self.standby_wait
        try:
            if self._loaded != term:
                # A new lease reads the tables afresh: last_run_at as the previous leader left it, and
                # edits that fired no signal. Keyed on the term, not the epoch: epochs restart after a
                # Redis reset, so a new lease can have an epoch number this beat had before.
                self._read_index()
                self._loaded = term
            else:
                self._poll_changes()
            interval = self._fire_next()
        except (DatabaseError, InterfaceError) as exc:
            logger.error("beat: database error during tick: %s", exc)
            return self.granularity
        except self.backend_errors as exc:
            return self.backend_failed(exc)
        return min(interval, self.granularity)

    # --- the due index ------------------------------------------------------------------

    def _change_mark(self) -> datetime | None:
        mark: datetime | None = self.Changes.last_change()
        return mark

    def _read_index(self) -> None:
        """Every enabled row's earliest due time, from a few columns read in chunks."""
        now = self.clock.time()
        self._mark = self._change_mark()  # read first: a change during the read is seen at the next poll
        self._grids = {}
        self._next_slots = {}
        self._load_grids()
        self._due, self._versions, self._seen = {}, {}, None
        heap: list[tuple[float, int]] = []
        for row in self._rows(self.Model.objects.filter(enabled=True)):
            due = self._apply_row(row, now)
            if due is not None:
                heap.append((due, row[0]))
        heapq.heapify(heap)
        self._due_heap = heap
        self._next_poll = time.monotonic() + _POLL
        self._reconcile_at = time.monotonic() + _RECONCILE
        self.index_reads += 1
        logger.debug("beat: due index read: %d enabled row(s)", len(self._due))

    def _rows(self, queryset: Any) -> Iterator[tuple[Any, ...]]:
        """The index columns of ``queryset``'s rows, times as POSIX seconds, fetched in chunks through
        a plain cursor: the ORM's per-value conversion costs as much as the read itself at 100,000
        rows, and so does parsing timestamps (PostgreSQL gives them as seconds instead)."""
        connection = connections[router.db_for_read(self.Model)]
        columns = list(_INDEX_COLUMNS)
        epoch = connection.vendor == "postgresql" and settings.USE_TZ  # timestamptz columns
        if epoch:
            table = connection.ops.quote_name(self.Model._meta.db_table)
            for i, name in enumerate(_INDEX_COLUMNS[-3:], start=len(_INDEX_COLUMNS) - 3):
                column = connection.ops.quote_name(self.Model._meta.get_field(name).column)
                queryset = queryset.annotate(**{f"{name}_ts": RawSQL(f"EXTRACT(EPOCH FROM {table}.{column})", ())})
                columns[i] = f"{name}_ts"
        sql, params = queryset.values_list(*columns).query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            seconds = _float if epoch else _epoch
            while chunk := cursor.fetchmany(_CHUNK):
                for pk, enabled, i, c, s, k, last_run_at, start_time, date_changed in chunk:
                    last, start, changed = seconds(last_run_at), seconds(start_time), seconds(date_changed)
                    yield pk, bool(enabled), i, c, s, k, last, start, changed

    def _apply_row(self, row: tuple[Any, ...], now: float) -> float | None:
        """Record a row's version and due time; None (and out of the index) when it is disabled."""
        pk, enabled, *fks, last_run_at, start_time, date_changed = row
        self._versions[pk] = date_changed
        if date_changed is not None and (self._seen is None or date_changed > self._seen):
            self._seen = date_changed
        if not enabled:
            self._due.pop(pk, None)
            return None
        due = now
        for kind, sid in zip(_KINDS, fks, strict=True):
            if sid is not None:
                due = self._first_due(kind, sid, last_run_at, start_time, date_changed, now)
                break
        self._due[pk] = due
        return due

    def _first_due(
        self,
        kind: str,
        sid: int,
        last_run_at: float | None,
        start_time: float | None,
        date_changed: float | None,
        now: float,
    ) -> float:
        # The earliest the row's entry can say it is due: its entry decides at that time (jitter,
        # start and end times, one-off rows and the misfire policy only ever move it later).
        if last_run_at is None:
            if start_time is not None:
                return start_time
            if date_changed is None:
                return now
            last_run_at = date_changed  # django-celery-beat's ModelEntry counts a new row from here
        key = (kind, sid, last_run_at)
        due = self._next_slots.get(key)
        if due is not None:
            return due
        grid = self._grid(kind, sid)
        if grid is None:
            return now
        try:
            due = grid.next(last_run_at)
        except Exception:  # a schedule the entry itself reports when due (its is_due check logs it)
            return now
        # Rows share their schedule and, once they run, their last slot: each pair is computed once.
        self._next_slots[key] = due
        return due

    def _grid(self, kind: str, sid: int) -> Grid | None:
        key = (kind, sid)
        if key not in self._grids:
            model = getattr(self.Model, kind).field.related_model
            self._grids[key] = self._grid_of(kind, model.objects.filter(pk=sid).first())
        return self._grids[key]

    def _load_grids(self) -> None:
        # interval and crontab rows are shared by many tasks: each is turned into a grid once
        for kind in ("interval", "crontab"):
            model = getattr(self.Model, kind).field.related_model
            for schedule_row in model.objects.all().iterator(chunk_size=_CHUNK):
                self._grids[(kind, schedule_row.pk)] = self._grid_of(kind, schedule_row)

    def _grid_of(self, kind: str, schedule_row: Any) -> Grid | None:
        if schedule_row is None or kind not in ("interval", "crontab"):
            return None  # solar and clocked rows are asked by their entry when they come due
        try:
            schedule = schedule_row.schedule
            if kind == "crontab":
                schedule = crontab.from_celery(schedule, tz=schedule_row.timezone or "UTC")
            return grid_for(schedule, self.app.timezone)
        except Exception:  # left to the entry, which refuses the row with its reason when it comes due
            return None

    def _push(self, pk: int, due: float) -> None:
        self._due[pk] = due
        heapq.heappush(self._due_heap, (due, pk))

    def _poll_changes(self) -> None:
        """Apply the rows saved since the last poll, when django-celery-beat's change marker moved."""
        if time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + _POLL
        close_old_connections()
        try:  # see django-celery-beat's schedule_changed: a REPEATABLE-READ transaction hides changes
            transaction.commit()
        except transaction.TransactionManagementError:
            pass
        mark = self._change_mark()
        if mark == self._mark:
            if time.monotonic() >= self._reconcile_at:
                self._read_index()
            return
        self._mark = mark
        since = to_datetime(self._seen - _CHANGE_SLACK) if self._seen is not None else None
        rows = self.Model.objects.all() if since is None else self.Model.objects.filter(date_changed__gte=since)
        # A disabled row the index never held is no change to it (the index reads enabled rows only).
        changed = [
            row
            for row in self._rows(rows)
            if self._versions.get(row[0], -1.0) != row[-1] and (row[1] or row[0] in self._due)
        ]
        if not changed:
            # A delete, a bulk update (the admin's enable and disable actions) or a schedule edit:
            # the marker moved and no saved row says which, so the whole index is read again.
            self._read_index()
            return
        now = self.clock.time()
        for row in changed:
            if row[2] is not None or row[3] is not None:  # its schedule row may be new or edited: built again
                self._grids.pop(("interval", row[2]), None)
                self._grids.pop(("crontab", row[3]), None)
                self._next_slots = {}
            due = self._apply_row(row, now)
            if due is not None:
                heapq.heappush(self._due_heap, (due, row[0]))
        logger.debug("beat: %d changed row(s) applied to the due index", len(changed))
        if len(self._due_heap) > 2 * len(self._due) + 1000:  # stale items of rows changed many times
            self._due_heap = [(due, pk) for pk, due in self._due.items()]
            heapq.heapify(self._due_heap)

    def _fire_next(self) -> float:
        """Fire the row at the top of the due index if it is due; the seconds until the next one."""
        heap, due_of = self._due_heap, self._due
        while heap and due_of.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # a row changed, disabled or deleted since this item was pushed
        if not heap:
            return self.granularity
        now = self.clock.time()
        due, pk = heap[0]
        if due > now:
            return due - now
        heapq.heappop(heap)
        # Until it is placed anew below: a failed fire is tried again at the next tick.
        self._push(pk, now + self.granularity)
        model = self.Model.objects.select_related(*_KINDS).filter(pk=pk, enabled=True).first()
        if model is None:  # deleted or disabled since the index read
            self._due.pop(pk, None)
            return 0.0
        try:
            entry = self.Entry(model, app=self.app)
        except ValueError:  # refused (logged with its reason): left out until the row changes
            self._due.pop(pk, None)
            return 0.0
        try:
            is_due, next_time_to_run = self.is_due(entry)
        except Exception:
            is_due, next_time_to_run = self._is_due_failed(entry)
        if not is_due:
            self._push(pk, now + max(float(next_time_to_run), 0.0))
            return 0.0
        self.reserve(entry)
        self.apply_entry(entry, producer=self.producer)
        following = None
        kind = next((k for k in _KINDS if getattr(model, f"{k}_id") is not None), None)
        grid = self._grid(kind, getattr(model, f"{kind}_id")) if kind is not None else None
        if grid is not None and entry.last_due is not None:
            following = grid.next(entry.last_due)  # its next slot on the grid, not "now + interval"
        self._push(pk, following if following is not None else now + max(float(next_time_to_run), 0.0))
        return 0.0

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
                self._loaded = None
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


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _epoch(value: Any) -> float | None:
    """A datetime column as a plain cursor reads it, as POSIX seconds (MySQL and SQLite give naive
    datetimes, in UTC with ``USE_TZ``, else in ``TIME_ZONE``)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC) if settings.USE_TZ else django_timezone.make_aware(value)
    seconds: float = value.timestamp()
    return seconds


def invalid_rows(app: Celery, names: list[str] | None = None) -> dict[str, str]:
    """Enabled django-celery-beat row name -> why ``SafeDatabaseScheduler`` leaves it out, checked as
    it builds each row's entry, without logging (``safe-time check`` and ``beat list`` show them);
    ``names``: only those rows (a page), else every row."""
    from django_celery_beat.models import PeriodicTask

    problems: dict[str, str] = {}
    # Neither logged nor remembered as logged: a leader in this process still says each one once.
    quiet, logger.disabled = logger.disabled, True
    refused = dict(_REFUSED.get(app, {}))
    try:
        query = PeriodicTask.objects.filter(enabled=True).order_by("name")
        for model in query if names is None else query.filter(name__in=names):
            try:
                SafeModelEntry(model, app=app)
            except Exception as exc:  # a row django-celery-beat or this scheduler cannot build
                problems[model.name] = str(exc) or exc.__class__.__name__
    finally:
        logger.disabled = quiet
        _REFUSED[app] = refused
    return problems
