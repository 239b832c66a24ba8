"""``safe-time beat ...``: list and show entries; add, remove, pause, resume, run, backfill and import them."""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import click
from celery.bin.base import CeleryCommand
from dateutil.parser import isoparse

from .. import constants as C
from .base import _app, _dump, _echo_table, _first_line, _loaded_app, safe_time


@safe_time.group(name="beat")
def beat_group() -> None:
    """Beat entries: list and show every entry; add, remove, pause, resume and run runtime ones; backfill."""


@contextlib.contextmanager
def _entry_errors() -> Iterator[None]:
    """A refused entry (``ScheduleError``, ``SerializationError``) ends the command with its message."""
    from ..exceptions import ScheduleError, SerializationError

    try:
        yield
    except (ScheduleError, SerializationError) as exc:
        raise click.ClickException(str(exc)) from None


def _json_arg(value: str | None, what: str, kind: type) -> Any:
    if value is None:
        return kind()
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{what} must be JSON: {exc}") from None
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"{what} must be a JSON {'array' if kind is list else 'object'}, got {value}")
    return parsed


@beat_group.command(name="list", cls=CeleryCommand)
@click.option("--prefix", default=None, help="Only entries whose name starts with this.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=C.BEAT_LIST_LIMIT, show_default=True, help="Entries per page."
)
@click.option("--after", default=None, help="Start after this name (the cursor the previous page printed).")
@click.option(
    "--state",
    type=click.Choice(["active", "paused", "invalid", "due-soon"]),
    default=None,
    help="Only entries in this state: active (enabled), paused, invalid (the leader disables them), "
    "due-soon (next fire within --soon).",
)
@click.option(
    "--soon", type=float, default=C.BEAT_LIST_SOON, show_default=True, help="Seconds ahead for --state due-soon."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def beat_list(
    ctx: click.Context,
    prefix: str | None,
    limit: int,
    after: str | None,
    state: str | None,
    soon: float,
    as_json: bool,
) -> None:
    """Entries by name, a page at a time: beat_schedule ones (source config) and runtime ones, with
    their last and next fire. Reads one page of the name index, not every entry; the counts come
    from the indexes. When more entries follow, the last line names the --after to go on with
    (on standard error with --json)."""
    from ..beat.entries import describe_schedule
    from ..beat.entry_pages import count_entries, merge_pages, page_entries

    app = _app(ctx)
    page = page_entries(app=app, after=after, limit=limit, prefix=prefix, state=state, soon=soon)
    found, problems, cursor = page.entries, dict(page.invalid), page.after
    database = _database_entries(ctx, prefix, after, limit, state)
    if database:
        # SafeDatabaseScheduler fires its table's rows, the beat_schedule copies among them: the
        # config entry of the same name is a copy that never fires.
        names = {row.name for row in database}
        found = [i for i in found if not (i.source == "config" and i.name in names)]
        problems.update(_database_problems(ctx, [row.name for row in database]))
        merged, cursor = merge_pages([(i.name, i) for i in found], cursor, [(r.name, r) for r in database], limit)
        kept = {name for name, _ in merged}
        found = [i for i in found if i.name in kept]
        database = [row for row in database if row.name in kept]
    if as_json:
        listed = [info.as_dict() for info in found] + [_database_dict(row) for row in database]
        listed.sort(key=lambda item: item["name"])
        for item in listed:
            item["invalid"] = problems.get(item["name"])
        _dump(listed)
        if cursor is not None:
            click.echo(f"more entries: --after {cursor}", err=True)
        return
    entries: list[tuple[Any, str, Any]] = [
        (i, describe_schedule(i.schedule), (i.options or {}).get("safe_time_overlap")) for i in found
    ]
    rows = []
    for item, schedule, overlap in entries + [(row, row.schedule, None) for row in database]:
        shown = "enabled" if item.enabled else "paused"
        if overlap not in (None, "allow"):
            shown += f"/{overlap}"
        if item.name in problems:  # the leader disables it (the others fire); the reason follows the table
            shown = "invalid"
        nxt = item.next_fire.isoformat() if item.next_fire else "-"
        last = item.last_fired.isoformat() if item.last_fired else "-"
        rows.append((item.name, item.source, shown, schedule, nxt, last, item.task))
    rows.sort(key=lambda r: r[0])
    _echo_table([("NAME", "SOURCE", "STATE", "SCHEDULE", "NEXT FIRE", "LAST FIRED", "TASK"), *rows])
    count = len(rows)
    counts = count_entries(app=app, soon=soon)
    click.echo(
        f"{count} entr{'y' if count == 1 else 'ies'} (of {counts['config']} config and {counts['runtime']} "
        f"runtime stored; {counts['scheduled']} scheduled, {counts['due_soon']} due within {soon:g}s)"
    )
    for name in sorted(problems):
        click.echo(f"invalid: {name}: {problems[name]}")
    if cursor is not None:
        click.echo(f"more entries: --after {cursor}")


def _database_entries(
    ctx: click.Context, prefix: str | None, after: str | None = None, limit: int | None = None, state: str | None = None
) -> list[Any]:
    """django-celery-beat's rows (``SafeDatabaseScheduler``'s entries), when Django runs with it:
    those after ``after`` starting with ``prefix``, the first ``limit`` of them in name order."""
    app = _loaded_app(ctx)
    from ..contrib.django.status import django_beat_in_use

    if not django_beat_in_use() or state in ("invalid", "due-soon"):
        return []
    from ..clock import local_time, to_datetime
    from ..contrib.django.overview import database_rows

    enabled = None if state is None else state == "active"
    try:
        rows = database_rows(app, to_datetime(local_time()), after=after, prefix=prefix, limit=limit, enabled=enabled)
    except Exception as exc:  # django-celery-beat installed but its tables not migrated here (as status)
        click.echo(f"django-celery-beat entries unreadable: {exc.__class__.__name__}: {_first_line(exc)}", err=True)
        return []
    return rows


def _database_problems(ctx: click.Context, names: list[str]) -> dict[str, str]:
    """Why ``SafeDatabaseScheduler`` leaves out these django-celery-beat rows (those it does)."""
    from ..contrib.django.schedulers import invalid_rows

    try:
        return invalid_rows(_loaded_app(ctx), names=names)
    except Exception as exc:  # as _database_entries
        click.echo(f"django-celery-beat rows unreadable: {exc.__class__.__name__}: {_first_line(exc)}", err=True)
        return {}


def _database_dict(row: Any) -> dict[str, Any]:
    return {
        "name": row.name,
        "source": row.source,
        "task": row.task,
        "schedule": row.schedule,
        "enabled": row.enabled,
        "last_fired": row.last_fired.isoformat() if row.last_fired else None,
        "next_fire": row.next_fire.isoformat() if row.next_fire else None,
    }


@beat_group.command(name="show", cls=CeleryCommand)
@click.argument("name")
@click.option("--last", type=click.IntRange(min=0), default=10, show_default=True, help="Runs and changes shown.")
@click.option("--history", "as_tables", is_flag=True, help="The last runs and changes as tables, not JSON.")
@click.pass_context
def beat_show(ctx: click.Context, name: str, last: int, as_tables: bool) -> None:
    """One entry as JSON, with its last runs ("runs") and changes ("changes"). A name that is no
    config or runtime entry but has runs or changes on record (a removed entry, a django-celery-beat
    row) shows those, with "source": null; exit 1 if nothing is known of it."""
    from ..beat.entries import get_entry
    from ..beat.history import entry_audit, entry_history

    app = _app(ctx)
    info = get_entry(name, app=app)
    runs = entry_history(name, app=app, limit=max(last, 1))
    changes = entry_audit(name, app=app, limit=max(last, 1))
    if info is None and not runs and not changes:
        click.echo(f"no beat entry {name!r}", err=True)
        sys.exit(1)
    runs, changes = (runs, changes) if last else ([], [])
    if info is None:
        click.echo(
            f"{name!r} is no config or runtime entry (removed, or a django-celery-beat row): its records only",
            err=True,
        )
    if not as_tables:
        head = info.as_dict() if info is not None else {"name": name, "source": None}
        _dump({**head, "runs": [r.as_dict() for r in runs], "changes": [c.as_dict() for c in changes]})
        return
    _echo_runs_and_changes(runs, changes)


def _echo_runs_and_changes(runs: Sequence[Any], changes: Sequence[Any]) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}s"

    click.echo(f"last {len(runs)} run(s):")
    if runs:
        rows: list[tuple[str, ...]] = [
            ("slot", "published", "lateness", "outcome", "runtime", "task id", "epoch", "host")
        ]
        for r in runs:
            published = r.published_at.isoformat(timespec="milliseconds") if r.published_at else "-"
            outcome = r.outcome + ("" if r.via == "beat" else f" ({r.via})")
            rows.append((
                r.slot.isoformat(), published, seconds(r.lateness), outcome,
                seconds(r.runtime), r.task_id or "-", "-" if r.epoch is None else str(r.epoch), r.host or "-",
            ))  # fmt: skip
        _echo_table(rows)
    click.echo(f"last {len(changes)} change(s):")
    if changes:
        rows = [("at", "action", "by", "version", "what")]
        for c in changes:
            rows.append((
                c.at.isoformat(timespec="seconds"), c.action, c.changed_by,
                "-" if c.version is None else str(c.version), _change_text(c),
            ))  # fmt: skip
        _echo_table(rows)


def _change_text(change: Any) -> str:
    """What changed, in one line: the differing fields of the definitions, or the detail."""
    if change.detail:
        return ", ".join(f"{k}={v}" for k, v in sorted(change.detail.items()))
    old, new = change.old or {}, change.new or {}
    fields = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "format")
    return ", ".join(f"{k}: {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in fields)


def _changed_by() -> str:
    """Who a change made here is by: the OS user and host (the audit's ``changed_by``)."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:
        user = "?"
    return f"{user}@{socket.gethostname()} (safe-time cli)"


@beat_group.command(name="add", cls=CeleryCommand)
@click.argument("name")
@click.argument("task")
@click.option("--cron", default=None, help='Crontab "minute hour day-of-month month day-of-week", e.g. "0 9 * * *".')
@click.option("--tz", default=None, help="IANA timezone of --cron (default: the app timezone).")
@click.option("--every", type=float, default=None, help="Interval in seconds.")
@click.option("--at", "at_", default=None, help="One-off at this ISO 8601 instant (naive = UTC).")
@click.option("--args", "args_json", default=None, help="Positional arguments, a JSON array.")
@click.option("--kwargs", "kwargs_json", default=None, help="Keyword arguments, a JSON object.")
@click.option("--options", "options_json", default=None, help='apply_async options, a JSON object ({"queue": "q"}).')
@click.option("--paused", is_flag=True, help="Store it paused (resume it later).")
@click.option("--jitter", type=float, default=None, help="Publish each slot within this many seconds of it.")
@click.option(
    "--catchup-window", type=float, default=None, help="Skip slots later than this many seconds, whatever the policy."
)
@click.option(
    "--overlap",
    type=click.Choice(list(C.OVERLAP_POLICIES)),
    default=None,
    help="What a slot does while a run of this entry is queued or running (default: allow).",
)
@click.option(
    "--overlap-ttl", type=float, default=None, help="Lease of a run in seconds (default: safe_time_lock_ttl)."
)
@click.pass_context
def beat_add(
    ctx: click.Context,
    name: str,
    task: str,
    cron: str | None,
    tz: str | None,
    every: float | None,
    at_: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    options_json: str | None,
    paused: bool,
    jitter: float | None,
    catchup_window: float | None,
    overlap: str | None,
    overlap_ttl: float | None,
) -> None:
    """Add or replace the runtime entry NAME running TASK (idempotent: the same definition changes nothing)."""
    from ..beat.entries import cron_spec, describe_schedule, save_entry

    if sum(x is not None for x in (cron, every, at_)) != 1:
        raise click.UsageError("give exactly one of --cron, --every or --at")
    if tz is not None and cron is None:
        raise click.UsageError("--tz goes with --cron")
    args = _json_arg(args_json, "--args", list)
    kwargs = _json_arg(kwargs_json, "--kwargs", dict)
    options = _json_arg(options_json, "--options", dict)
    with _entry_errors():
        if cron is not None:
            schedule: Any = cron_spec(cron, tz)
        elif every is not None:
            schedule = every
        else:
            schedule = {"type": "at", "at": at_}
        info = save_entry(
            name,
            task,
            schedule,
            args=args,
            kwargs=kwargs,
            options=options,
            enabled=not paused,
            app=_loaded_app(ctx),
            jitter=jitter,
            catchup_window=catchup_window,
            overlap=overlap,
            overlap_ttl=overlap_ttl,
            changed_by=_changed_by(),
        )
    click.echo(f"{info.name}: {describe_schedule(info.schedule)} -> {info.task} (version {info.version})")


@beat_group.command(name="remove", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
def beat_remove(ctx: click.Context, name: str) -> None:
    """Delete the runtime entry NAME (the leader stops it at its next tick); exit 1 if there is none."""
    from ..beat.entries import delete_entry

    with _entry_errors():
        removed = delete_entry(name, app=_app(ctx), changed_by=_changed_by())
    if not removed:
        click.echo(f"no runtime entry {name!r}", err=True)
        sys.exit(1)
    click.echo(f"{name}: removed")


def _set_enabled(ctx: click.Context, name: str, enabled: bool, note: str | None = None, until: Any = None) -> None:
    from ..beat.entries import set_enabled

    with _entry_errors():
        info = set_enabled(name, enabled, app=_app(ctx), note=note, until=until, changed_by=_changed_by())
    if info is None:
        click.echo(f"no runtime entry {name!r}", err=True)
        sys.exit(1)
    if enabled:
        click.echo(f"{name}: resumed")
    else:
        until_text = f" until {info.paused_until.isoformat()}" if info.paused_until is not None else ""
        click.echo(f"{name}: paused{until_text}" + (f" ({info.pause_note})" if info.pause_note else ""))


def _until(text: str | None) -> Any:
    """``--until``: an ISO 8601 instant (naive = UTC) or a number of seconds from now."""
    import datetime as dt

    if text is None:
        return None
    try:
        return dt.timedelta(seconds=float(text))
    except ValueError:
        pass
    try:
        return isoparse(text)  # dateutil: "Z" and the other ISO 8601 forms on every Python
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: an ISO 8601 instant or a number of seconds", param_hint="--until"
        ) from None


@beat_group.command(name="pause", cls=CeleryCommand)
@click.argument("name")
@click.option("--note", default=None, help="Why (and who): shown by beat show.")
@click.option("--until", "until_text", default=None, help="Resume by itself then: ISO 8601 instant or seconds.")
@click.pass_context
def beat_pause(ctx: click.Context, name: str, note: str | None, until_text: str | None) -> None:
    """Pause the runtime entry NAME, keeping its last and next slot; with --until the leader resumes it then."""
    _set_enabled(ctx, name, False, note=note, until=_until(until_text))


@beat_group.command(name="resume", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
def beat_resume(ctx: click.Context, name: str) -> None:
    """Resume NAME at its next slot (the slots that fell while it was paused are skipped)."""
    _set_enabled(ctx, name, True)


@beat_group.command(name="run-now", cls=CeleryCommand)
@click.argument("name")
@click.option("--wait", type=float, default=10.0, show_default=True, help="Seconds to wait for the leader.")
@click.pass_context
def beat_run_now(ctx: click.Context, name: str, wait: float) -> None:
    """Publish one run of NAME now through the leader's dispatch guard (at most once); exit 1 when no
    leader published it within --wait (the request stays: the next leader publishes it)."""
    import time

    from ..beat.entries import run_now, run_now_fired

    app = _app(ctx)
    with _entry_errors():
        slot = run_now(name, app=app, changed_by=_changed_by())
    deadline = time.monotonic() + wait
    while not run_now_fired(name, slot, app=app):
        if time.monotonic() >= deadline:
            click.echo(f"{name}: requested slot {slot.isoformat()}; no leader published it within {wait:g}s", err=True)
            sys.exit(1)
        time.sleep(0.1)
    click.echo(f"{name}: published slot {slot.isoformat()}")


def _instant(text: str, hint: str) -> Any:
    """An ISO 8601 instant (naive = UTC) given on the command line."""
    try:
        return isoparse(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected an ISO 8601 instant", param_hint=hint) from None


@beat_group.command(name="backfill", cls=CeleryCommand)
@click.argument("name")
@click.option("--from", "start", required=True, help="First instant of the range, ISO 8601 (naive = UTC).")
@click.option("--to", "end", required=True, help="End of the range (excluded), ISO 8601 (naive = UTC), not after now.")
@click.option(
    "--max", "limit", type=click.IntRange(min=1), default=C.BEAT_BACKFILL_MAX, show_default=True,
    help="Refuse a range with more slots than this (nothing is published then).",
)  # fmt: skip
@click.option(
    "--overlap",
    type=click.Choice(list(C.OVERLAP_POLICIES)),
    default=None,
    help="The overlap policy the backfilled slots go through (default: the entry's own).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def beat_backfill(
    ctx: click.Context, name: str, start: str, end: str, limit: int, overlap: str | None, as_json: bool
) -> None:
    """Publish every slot of NAME in [--from, --to) that was not fired, each at most once (a slot the
    leader or another backfill published is not published again)."""
    from ..beat.backfill import run_backfill

    with _entry_errors():
        result = run_backfill(
            name, _instant(start, "--from"), _instant(end, "--to"), app=_app(ctx), limit=limit,
            changed_by=_changed_by(), overlap=overlap,
        )  # fmt: skip
    if as_json:
        _dump(
            {
                "entry": name,
                "published": [slot.isoformat() for slot in result.published],
                "dropped": [slot.isoformat() for slot in result.dropped],
            }
        )
        return
    for slot in result.published:
        click.echo(f"{name}: published slot {slot.isoformat()}")
    for slot in result.dropped:
        click.echo(f"{name}: dropped slot {slot.isoformat()} (overlap policy)")
    click.echo(f"{name}: {len(result.published)} slot(s) published")


#: ``beat show --json`` fields that describe an entry's state, not its definition: an import leaves them out.
_SHOWN_ONLY = (
    "last_fired",
    "next_fire",
    "source",
    "version",
    "pause_note",
    "paused_until",
    "runs",
    "changes",
    "invalid",
)


@beat_group.command(name="import", cls=CeleryCommand)
@click.argument("file", type=click.File("r"))
@click.pass_context
def beat_import(ctx: click.Context, file: Any) -> None:
    """Create or replace runtime entries from FILE ("-": standard input): one JSON object per line in
    the ``beat show`` shape, or the JSON array ``beat list --json`` prints. What describes the state
    (next_fire, version, ...) is ignored, and entries that are not runtime ones (config, database)
    are skipped. Idempotent; entries are stored in chunks, each validated whole first."""
    from ..beat.entries import save_entries

    skipped = 0

    def rows() -> Any:
        head = file.read(1)
        while head.isspace():
            head = file.read(1)
        if head == "[":  # beat list --json
            try:
                listed = json.loads(head + file.read())
            except ValueError as exc:
                raise click.ClickException(f"{file.name}: not a JSON array: {exc}") from None
            yield from enumerate(listed, start=1)
            return
        for number, line in enumerate(itertools.chain([head + file.readline()], file), start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as exc:
                raise click.ClickException(f"{file.name}: line {number} is not JSON: {exc}") from None

    def items() -> Any:
        nonlocal skipped
        for number, item in rows():
            if not isinstance(item, dict):
                raise click.ClickException(f"{file.name}: item {number} must be a JSON object")
            if "source" in item and item["source"] != C.ENTRY_SOURCE_RUNTIME:
                skipped += 1  # beat_schedule's or a database row: not stored as runtime entries
                continue
            yield {k: v for k, v in item.items() if k not in _SHOWN_ONLY}

    with _entry_errors():
        changed = save_entries(items(), app=_loaded_app(ctx), changed_by=_changed_by())
    note = f", {skipped} not runtime entries skipped" if skipped else ""
    click.echo(f"{changed} entries created or changed{note}")


@beat_group.command(name="import-redbeat", cls=CeleryCommand)
@click.option(
    "--prefix",
    default=None,
    help="celery-redbeat's redbeat_key_prefix (default: the app's redbeat_key_prefix, else redbeat:).",
)
@click.option(
    "--redis-url",
    default=None,
    help="The Redis holding redbeat's entries (default: the app's redbeat_redis_url, else its broker_url).",
)
@click.option("--dry-run", is_flag=True, help="Decode and list the entries, store nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def beat_import_redbeat(
    ctx: click.Context, prefix: str | None, redis_url: str | None, dry_run: bool, as_json: bool
) -> None:
    """Copy celery-redbeat's entries and their last run into runtime entries (redbeat's keys are left
    as they are); exit 1 when an entry could not be imported or none was found."""
    from ..beat.redbeat import import_redbeat
    from ..exceptions import ImproperlyConfigured

    try:
        result = import_redbeat(_app(ctx), prefix, dry_run=dry_run, redis_url=redis_url)
    except ImproperlyConfigured as exc:
        raise click.ClickException(str(exc)) from None
    found = result.imported or result.unchanged or result.skipped or result.failed
    if as_json:
        _dump(result.as_dict())
    elif not found:
        click.echo(f"no redbeat entries under {result.prefix} at {result.redis_url}", err=True)
    else:
        verb = "would import" if dry_run else "imported"
        for name in result.imported:
            click.echo(f"{verb}  {name}")
        for name in result.unchanged:
            click.echo(f"unchanged  {name}")
        for name, why in result.skipped.items():
            click.echo(f"skipped  {name}: {why}")
        for name, error in result.failed.items():
            click.echo(f"FAILED  {name}: {error}", err=True)
        click.echo(
            f"{len(result.imported)} {verb}, {len(result.unchanged)} unchanged, {len(result.skipped)} skipped, "
            f"{len(result.failed)} failed (from {result.prefix} at {result.redis_url})"
        )
    sys.exit(1 if result.failed or not found else 0)
