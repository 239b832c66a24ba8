"""What the admin's "Safe time" overview page shows, read with the CLI's own status functions.

Beat (``describe_beat``, ``list_entries``), delays (``describe_delays``), locks (``describe_locks``)
and flow control (``describe_flow``) are the sections of ``celery safe-time status``; this module only
adds what a page needs beside them: django-celery-beat rows (when that app is installed), the per-hour due
counts of the chart, and an error per section instead of an exception, so an unreachable Redis or
database turns one box red and never the whole page into a 500.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib import import_module
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery, current_app

from ... import constants as C
from ...clock import UTC, as_utc, to_datetime
from ...exceptions import SafeTimeError
from .chart import CHART_HOURS, HourBucket, hour_buckets, hour_start

logger = logging.getLogger(__name__)

#: Django setting: the Celery app the admin reads (an app object, or "module:attr" / "module.attr").
APP_SETTING = C.DJANGO_APP_SETTING

#: What a section catches: Redis or the coordination database down, the store down, a bad row;
#: logged, then shown in red.
SECTION_ERRORS: tuple[type[Exception], ...] = (
    redis.RedisError,
    sa.exc.SQLAlchemyError,
    OSError,
    SafeTimeError,
    ValueError,
)


def celery_app() -> Celery:
    """The Celery app of the project: ``settings.SAFE_TIME_CELERY_APP``, else the app using this
    Django store, else ``celery.current_app``.

    ``current_app`` alone is not enough: Celery keeps it per thread, and the server's request
    threads are not the one that created the project's app.
    """
    from celery._state import _get_active_apps
    from django.conf import settings

    configured = getattr(settings, APP_SETTING, None)
    if isinstance(configured, Celery):
        return configured
    if isinstance(configured, str) and configured:
        module, _, attr = configured.replace(":", ".").rpartition(".")
        app = getattr(import_module(module), attr)
        if not isinstance(app, Celery):
            raise TypeError(f"settings.{APP_SETTING} = {configured!r} is not a Celery app")
        return app
    for app in list(_get_active_apps()):
        if app.conf.get("safe_time_store_url") == C.DJANGO_STORE:
            return app
    found: Celery = current_app._get_current_object()
    return found


@dataclass
class EntryRow:
    """One beat entry as the overview lists it."""

    name: str
    source: str  # "config", "runtime" or "database" (django-celery-beat)
    task: str
    schedule: str
    enabled: bool
    last_fired: datetime | None
    next_fire: datetime | None
    pause_note: str | None = None  # why a paused runtime entry was paused
    paused_until: datetime | None = None  # when it resumes by itself
    url: str | None = None  # its page, when the user may open it and the name fits in a URL
    invalid: str | None = None  # why the leader disables it (it never fires), else None


@dataclass
class Overview:
    """Everything the page shows; a section that could not be read has its ``*_error`` set."""

    now: datetime
    #: lateness above this shows red: ``status --probe sweep``'s default limit
    max_lateness: float = 60.0
    beat: dict[str, Any] = field(default_factory=dict)
    beat_error: str | None = None
    entries: list[EntryRow] = field(default_factory=list)
    entries_error: str | None = None
    #: the page of entries shown starts after this name and keeps the names starting with the prefix
    entries_from: str | None = None
    entries_prefix: str | None = None
    #: where the next page starts (None: this is the last)
    entries_after: str | None = None
    #: the sizes of the schedule, from the indexes (``count_entries``)
    entries_counts: dict[str, Any] = field(default_factory=dict)
    #: django-celery-beat's rows were left out: the user lacks its view permission
    database_entries_hidden: bool = False
    delays: dict[str, Any] = field(default_factory=dict)
    delays_error: str | None = None
    buckets: list[HourBucket] = field(default_factory=list)
    overdue: int = 0
    chart_error: str | None = None
    locks: dict[str, Any] = field(default_factory=dict)
    locks_error: str | None = None
    flow: dict[str, Any] = field(default_factory=dict)
    flow_error: str | None = None

    @property
    def chart_total(self) -> int:
        return sum(bucket.count for bucket in self.buckets)

    @property
    def leader(self) -> dict[str, Any] | None:
        leader = self.beat.get("leader")
        return leader if isinstance(leader, dict) else None


@dataclass
class EntryPage:
    """One beat entry's page: its last runs and changes; a part that could not be read has its error."""

    runs: list[Any] = field(default_factory=list)
    runs_error: str | None = None
    changes: list[Any] = field(default_factory=list)
    changes_error: str | None = None


def entry_page(app: Celery, name: str) -> EntryPage:
    """The runs and changes of the beat entry ``name`` (a config or runtime entry, or a
    django-celery-beat row fired by ``SafeDatabaseScheduler``; empty for an entry that has none)."""
    from django.db import Error as DjangoDbError

    from ...beat.history import entry_audit, entry_history

    errors = (*SECTION_ERRORS, DjangoDbError)
    page = EntryPage()
    try:
        page.runs = entry_history(name, app=app)
    except errors as exc:
        page.runs_error = _failed("run history", exc)
    try:
        page.changes = [
            {"record": c, "old": _json_text(c.old), "new": _json_text(c.detail or c.new)}
            for c in entry_audit(name, app=app)
        ]
    except errors as exc:
        page.changes_error = _failed("change audit", exc)
    return page


def _json_text(value: Any) -> str:
    return "-" if value is None else json.dumps(value, indent=1, sort_keys=True)


def _failed(section: str, exc: BaseException) -> str:
    logger.warning("safe-time admin overview: %s unavailable: %s", section, exc)
    return f"{exc.__class__.__name__}: {exc}"


def config_and_runtime_entries(
    app: Celery, *, after: str | None = None, prefix: str | None = None, limit: int = C.BEAT_LIST_LIMIT
) -> tuple[list[EntryRow], str | None]:
    """One page of the config and runtime entries (``page_entries``: never every entry), the invalid
    ones marked, and where the next page starts (None: the last page)."""
    from ...beat.entries import describe_schedule
    from ...beat.entry_pages import page_entries

    # The web process need not import the worker's tasks: an unknown task is check's to say.
    page = page_entries(app=app, after=after, prefix=prefix, limit=limit, tasks=False)
    rows = [
        EntryRow(
            i.name,
            i.source,
            i.task,
            describe_schedule(i.schedule),
            i.enabled,
            i.last_fired,
            None if i.name in page.invalid else i.next_fire,  # an invalid entry never fires
            pause_note=i.pause_note,
            paused_until=i.paused_until,
            invalid=page.invalid.get(i.name),
        )
        for i in page.entries
    ]
    return rows, page.after


def database_rows(
    app: Celery,
    now: datetime,
    *,
    after: str | None = None,
    prefix: str | None = None,
    limit: int | None = None,
    enabled: bool | None = None,
) -> list[EntryRow]:
    """django-celery-beat's rows (what ``SafeDatabaseScheduler`` fires), next fire on its grid, in
    name order: those after ``after``, starting with ``prefix``, ``enabled`` (None: either), the
    first ``limit`` (None: all); the filters are the query's, so a page reads only its rows."""
    from django.apps import apps

    if not apps.is_installed("django_celery_beat"):
        return []
    from django_celery_beat.models import PeriodicTask

    from ...beat.slots import grid_for
    from .rows import row_schedule

    query = PeriodicTask.objects.order_by("name")
    if after is not None:
        query = query.filter(name__gt=after)
    if prefix:
        query = query.filter(name__startswith=prefix)
    if enabled is not None:
        query = query.filter(enabled=enabled)
    rows = []
    for task in query if limit is None else query[:limit]:
        try:
            # the row's own timezone with the DST rules, as SafeModelEntry fires it
            schedule = row_schedule(task)
            describe = str(getattr(task, "crontab", None) or getattr(task, "interval", None) or task.schedule)
        except Exception as exc:  # a row with no schedule left (its schedule row deleted)
            rows.append(EntryRow(task.name, "database", task.task, f"broken: {exc}", False, None, None))
            continue
        last = as_utc(task.last_run_at) if task.last_run_at else None
        next_fire: datetime | None = None
        if task.enabled and not (task.one_off and task.total_run_count):
            try:
                since = (last or now).timestamp()
                next_fire = to_datetime(grid_for(schedule, app.timezone).next(since))
            except Exception:  # a schedule the grid cannot step (clocked, custom): leave it blank
                next_fire = None
        rows.append(EntryRow(task.name, "database", task.task, describe, task.enabled, last, next_fire))
    return rows


def merged_entries(entries: list[EntryRow], database: list[EntryRow]) -> list[EntryRow]:
    """``entries`` and django-celery-beat's rows, each name once: ``SafeDatabaseScheduler`` copies the
    ``beat_schedule`` entries (the sweep's among them) into its table and fires those rows, so a
    config entry of the same name is the copy that never fires."""
    names = {row.name for row in database}
    return [row for row in entries if not (row.source == "config" and row.name in names)] + database


def mark_invalid(app: Celery, entries: list[EntryRow]) -> None:
    """Set ``invalid`` on the django-celery-beat rows of ``entries`` that ``SafeDatabaseScheduler``
    leaves out (the config and runtime ones come marked from their page): an invalid entry never
    fires, so it shows its reason, not a next fire time."""
    from django.apps import apps

    database = [row.name for row in entries if row.source == "database"]
    if not database or not apps.is_installed("django_celery_beat"):
        return
    from .schedulers import invalid_rows

    problems = invalid_rows(app, names=database)
    for row in entries:
        if row.source == "database" and row.name in problems:
            row.invalid = problems[row.name]
            row.next_fire = None


def due_counts(now: datetime, hours: int = CHART_HOURS) -> tuple[dict[datetime, int], int]:
    """Pending delays per hour for ``hours`` from ``now``'s hour, and how many are due before it."""
    from django.db.models import Count
    from django.db.models.functions import TruncHour

    from .models import DelayedTask

    first = hour_start(now)
    pending = DelayedTask.objects.filter(status=C.STATUS_PENDING)
    window = pending.filter(due_at__gte=first, due_at__lt=first + timedelta(hours=hours))
    per_hour = window.annotate(hour=TruncHour("due_at", tzinfo=UTC)).order_by().values("hour").annotate(n=Count("id"))
    counts = {as_utc(item["hour"]): int(item["n"]) for item in per_hour}
    overdue = int(pending.filter(due_at__lt=first).count())
    return counts, overdue


def gather(
    app: Celery,
    now: datetime | None = None,
    *,
    database_entries: bool = True,
    after: str | None = None,
    prefix: str | None = None,
    limit: int = C.BEAT_LIST_LIMIT,
) -> Overview:
    """Read every section; ``now`` defaults to the store's clock (the one lateness is measured on).

    ``database_entries=False`` leaves django-celery-beat's rows out (a user without its view
    permission). The entries are one page: ``limit`` names after ``after`` starting with ``prefix``."""
    from django.db import Error as DjangoDbError

    from ...delays.admin import describe_delays
    from ...locks.admin import describe_flow, describe_locks
    from .status import describe_beat_with_django

    errors = (*SECTION_ERRORS, DjangoDbError)
    if now is None:
        try:
            from .store import DjangoStore

            now = DjangoStore().now()
        except errors:
            now = datetime.now(UTC)
    from ...checks import default_max_lateness
    from ...config import get_config

    view = Overview(now=now, max_lateness=default_max_lateness(get_config(app).sweep_interval))
    try:
        view.beat = describe_beat_with_django(app)
        view.beat_error = view.beat.get("error")
    except errors as exc:
        view.beat_error = _failed("beat", exc)
    from ...beat.entry_pages import count_entries, merge_pages

    view.entries_from, view.entries_prefix = after, prefix
    entries: list[EntryRow] = []
    cursor: str | None = None
    try:
        entries, cursor = config_and_runtime_entries(app, after=after, prefix=prefix, limit=limit)
        view.entries_counts = count_entries(app)
    except errors as exc:
        view.entries_error = _failed("beat entries", exc)
    try:
        if database_entries:
            database = database_rows(app, now, after=after, prefix=prefix, limit=limit)
            if database:
                page, cursor = merge_pages(
                    [(r.name, r) for r in entries], cursor, [(r.name, r) for r in database], limit
                )
                entries = merged_entries(
                    [r for _, r in page if r.source != "database"], [r for _, r in page if r.source == "database"]
                )
                entries.sort(key=lambda row: row.name)
        else:
            view.database_entries_hidden = True
    except errors as exc:
        view.entries_error = _failed("django-celery-beat entries", exc)
    try:
        mark_invalid(app, entries)
    except errors as exc:
        view.entries_error = _failed("entry checks", exc)
    view.entries_after = cursor
    view.entries = entries
    try:
        view.delays = describe_delays(app)
        view.delays_error = view.delays.get("error")
    except errors as exc:
        view.delays_error = _failed("delays", exc)
    try:
        counts, view.overdue = due_counts(now)
        view.buckets = hour_buckets(counts, now)
    except errors as exc:
        view.chart_error = _failed("due chart", exc)
    try:
        view.locks = describe_locks(app)
        view.locks_error = view.locks.get("error")
    except errors as exc:
        view.locks_error = _failed("locks", exc)
    try:
        view.flow = describe_flow(app)
        view.flow_error = view.flow.get("error")
    except errors as exc:
        view.flow_error = _failed("flow control", exc)
    return view
