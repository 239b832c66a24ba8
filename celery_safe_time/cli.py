"""``celery -A proj safe-time ...``: the operator's command (a ``celery.commands`` plugin).

Sections: ``check`` and ``status`` (every capability), then ``beat ...``, ``delays ...``, ``sweep`` and
``locks ...``.
Each command imports its capability lazily, so ``celery --help`` stays fast and Django-free.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import click
from celery import Celery
from celery.bin.base import CeleryCommand, CLIContext, handle_preload_options
from dateutil.parser import isoparse

from . import constants as C
from .checks import PROBES, beat_verdict, default_max_lateness, run_checks, sweep_verdict, unreachable, worst
from .config import get_config, mask_url
from .constants import DELAY_STATUSES, PURGEABLE_STATUSES
from .health import Check, error_text

_MARK = {"ok": ("OK", "green"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "red")}


def _app(ctx: click.Context) -> Celery:
    obj: CLIContext = ctx.obj
    app: Celery = obj.app
    return app


def _loaded_app(ctx: click.Context) -> Celery:
    """The app with what a worker imports first: for the commands that touch the store or run tasks."""
    obj: CLIContext = ctx.obj
    app = _app(ctx)
    if not getattr(obj, "safe_time_loaded", False):
        obj.safe_time_loaded = True
        _load_like_a_worker(app)
    return app


def _load_like_a_worker(app: Celery) -> None:
    """Import what a worker imports before it runs anything: Celery's Django fixup calls
    ``django.setup()`` on this signal (a proj/celery.py laid out as Django's docs show never calls
    it), and ``autodiscover_tasks()``/``imports`` register the tasks, which ``sweep`` needs to
    publish (a row of an unregistered task is marked failed). Django's system checks, which the
    fixup runs for a worker, are skipped: seconds per command, and not what these commands check."""
    skip = os.environ.get("CELERY_SKIP_CHECKS")
    os.environ["CELERY_SKIP_CHECKS"] = "1"
    try:
        app.loader.import_default_modules()
    finally:
        if skip is None:
            del os.environ["CELERY_SKIP_CHECKS"]
        else:
            os.environ["CELERY_SKIP_CHECKS"] = skip
    if os.environ.get("DJANGO_SETTINGS_MODULE"):
        try:
            import django
            from django.apps import apps
        except ImportError:
            return
        if not apps.ready:  # a loader without Celery's fixup (app.loader is django's, or a custom one)
            django.setup()


def _dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, sort_keys=True))


class SafeTimeGroup(click.Group):
    """The ``safe-time`` group: a Redis or store that cannot be reached ends any subcommand with one
    line naming the setting, the masked URL and the cause (exit 1), instead of a long traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        import redis

        from .exceptions import RedisUnavailable, StoreError

        try:
            return super().invoke(ctx)
        except (redis.ConnectionError, redis.TimeoutError, RedisUnavailable) as exc:
            click.echo(_redis_unreachable(ctx, exc), err=True)
        except StoreError as exc:
            click.echo(f"error: safe_time_store_url: {_first_line(exc)}", err=True)
        ctx.exit(1)


def _echo_table(rows: Sequence[Sequence[str]]) -> None:
    """``rows`` (the header first) as left-aligned columns two spaces apart."""
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _redis_unreachable(ctx: click.Context, exc: BaseException) -> str:
    app = _app(ctx)
    url = mask_url(get_config(app).redis_url)
    where = "safe_time_redis_url" if app.conf.get("safe_time_redis_url") else "safe_time_redis_url (unset: broker_url)"
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    return f"error: cannot reach Redis at {url} ({where}): {_first_line(cause)}"


@click.group(name="safe-time", cls=SafeTimeGroup)
@click.pass_context
@handle_preload_options
def safe_time(ctx: click.Context, **kwargs: Any) -> None:
    """celery-safe-time: single-leader beat, durable delays, overlap locks."""


# === check and status =========================================================


@safe_time.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Check clocks, Redis and the store; exit 1 on any failure (usable as a probe)."""
    from .config import log_setting_warnings

    # The settings warnings are rows of the report here, not log lines beside it.
    log_setting_warnings(False)
    try:
        checks = run_checks(_loaded_app(ctx))
    finally:
        log_setting_warnings(True)
    if not any(c.name == "settings" and c.status == "fail" for c in checks):
        checks.extend(_entry_checks(_app(ctx)))
    overall = worst(checks)
    if as_json:
        _dump({"status": overall, "checks": [c.as_dict() for c in checks]})
    else:
        _print_checks(ctx, checks)
        label, color = _MARK[overall]
        click.echo("overall: " + ctx.obj.style(label, fg=color, bold=True))
    sys.exit(1 if overall == "fail" else 0)


def _invalid_entries(app: Celery) -> tuple[dict[str, str], str | None]:
    """Every invalid beat entry (config, runtime and, under Django, django-celery-beat rows) with
    its reason, and why the entries could not be read (or None)."""
    from .beat.entries import invalid_entries
    from .contrib.django.status import django_beat_in_use

    try:
        problems = invalid_entries(app)
    except Exception as exc:  # the beat backend unreachable: the other rows of check say why
        return {}, f"beat entries unreadable: {exc.__class__.__name__}: {_first_line(exc)}"
    if django_beat_in_use():
        from .contrib.django.schedulers import invalid_rows

        try:
            problems.update(invalid_rows(app))
        except Exception as exc:  # django-celery-beat installed but its tables not migrated here
            return problems, f"django-celery-beat rows unreadable: {exc.__class__.__name__}: {_first_line(exc)}"
    return problems, None


def _entry_checks(app: Celery) -> list[Check]:
    """``check``'s rows for the beat entries: each invalid one named with its reason (the leader
    disables it; the others fire), or one OK row."""
    problems, unreadable = _invalid_entries(app)
    checks = [Check("entries", "warn", f"{name}: {reason}") for name, reason in sorted(problems.items())]
    if unreadable is not None:
        checks.append(Check("entries", "warn", unreadable))
    return checks or [Check("entries", "ok", "every beat entry valid")]


def _print_checks(ctx: click.Context, checks: list[Check]) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        label, color = _MARK[c.status]
        click.echo(f"{ctx.obj.style(f'{label:<4}', fg=color, bold=True)}  {c.name:<{width}}  {c.detail}")


@safe_time.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--probe",
    "probes",
    multiple=True,
    type=click.Choice(PROBES),
    help="Only check this (repeatable) and exit 1 when unhealthy: beat = a leader holds the lease, "
    "sweep = the oldest due delay is at most --max-lateness late, store = the store answers.",
)
@click.option(
    "--max-lateness",
    default=None,
    callback=lambda ctx, param, value: None if value is None else _duration(ctx, param, value),
    help="How late the oldest due delay may be for --probe sweep: seconds or 5m, 1h "
    "(default max(60 s, 3 x sweep interval)).",
)
@click.pass_context
def status(ctx: click.Context, as_json: bool, probes: tuple[str, ...], max_lateness: float | None) -> None:
    """Beat leader, stored delays, held locks and flow control; with --probe, a health verdict (exit 1 = unhealthy)."""
    app = _loaded_app(ctx)
    if probes:
        checks = run_probes(app, list(probes), max_lateness=max_lateness)
        overall = worst(checks)
        if as_json:
            _dump({"status": overall, "probes": [c.as_dict() for c in checks]})
        else:
            _print_checks(ctx, checks)
        sys.exit(1 if overall == "fail" else 0)
    sections = {name: describe(app) for name, describe in _status_sections()}
    if as_json:
        _dump(sections)
        return
    for name, data in sections.items():
        click.echo(ctx.obj.style(f"[{name}]", bold=True))
        _print_tree(data, indent=2)


# The readers behind ``status --probe``: one or two round trips each, never raising; the verdicts they
# hand what was read to are in :mod:`.checks` (pure, tested without services).


def probe_beat(app: Celery) -> Check:
    from .beat.backends import beat_backend

    config = get_config(app)
    backend = beat_backend(config)
    errors: tuple[type[Exception], ...] = (*backend.errors, OSError)
    try:
        view = backend.lease_view()
    except errors as exc:
        return Check(
            "beat", "fail", f"{backend.label} {backend.where().split(' ', 1)[-1]} unreachable: {error_text(exc)}"
        )
    return beat_verdict(view.ttl_ms, view.info, view.epoch)


def probe_store(app: Celery) -> Check:
    from .delays.backends import get_store

    url = mask_url(get_config(app).store_url)
    try:
        get_store(app).ping()
    except Exception as exc:  # a probe reports every failure, whatever the driver raises
        return Check("store", "fail", unreachable(url, exc))
    return Check("store", "ok", f"{url} reachable", value=url)


def probe_sweep(app: Celery, max_lateness: float | None = None) -> Check:
    from .delays.backends import get_store

    config = get_config(app)
    limit = default_max_lateness(config.sweep_interval) if max_lateness is None else max_lateness
    try:
        store = get_store(app)
        oldest = store.oldest_due(C.STATUS_PENDING)
        now = store.now()
    except Exception as exc:  # any store failure (StoreError, a driver's own) fails the probe
        return Check("sweep", "fail", unreachable(f"store {mask_url(config.store_url)}", exc))
    return sweep_verdict(now, oldest, limit)


def run_probes(app: Celery, names: list[str], *, max_lateness: float | None = None) -> list[Check]:
    """The named probes in the given order (each once). Nothing is logged: the caller shows the
    verdicts (the command prints each once, on stdout)."""
    checks: list[Check] = []
    for name in dict.fromkeys(names):
        if name == "beat":
            checks.append(probe_beat(app))
        elif name == "sweep":
            checks.append(probe_sweep(app, max_lateness))
        elif name == "store":
            checks.append(probe_store(app))
        else:
            raise ValueError(f"unknown probe {name!r}; use one of {', '.join(PROBES)}")
    return checks


def _status_sections() -> list[tuple[str, Any]]:
    """(title, describe(app) -> dict) pairs, one per feature, imported lazily."""
    from .contrib.django.status import describe_beat_with_django
    from .delays.admin import describe_delays
    from .locks.admin import describe_flow, describe_locks

    return [
        ("beat", describe_beat_with_django),
        ("delays", describe_delays),
        ("locks", describe_locks),
        ("flow", describe_flow),
    ]


def _print_tree(data: Any, indent: int) -> None:
    pad = " " * indent
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, (dict, list)) and value:
                click.echo(f"{pad}{key}:")
                _print_tree(value, indent + 2)
            else:
                click.echo(f"{pad}{key}: {value}")
    elif isinstance(data, list):
        for item in data:
            if isinstance(item, dict):
                click.echo(pad + "- " + ", ".join(f"{k}={v}" for k, v in item.items()))
            else:
                click.echo(f"{pad}- {item}")
    else:
        click.echo(f"{pad}{data}")


# === beat =====================================================================


@safe_time.group(name="beat")
def beat_group() -> None:
    """Beat entries: list and show every entry; add, remove, pause, resume and run runtime ones; backfill."""


def _entry_errors() -> tuple[type[Exception], ...]:
    from .exceptions import ScheduleError, SerializationError

    return (ScheduleError, SerializationError)


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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def beat_list(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Every entry: beat_schedule ones (source config) and runtime ones, with their last and next fire."""
    from .beat.entries import describe_schedule, list_entries

    app = _app(ctx)
    found = list_entries(app=app, prefix=prefix)
    database = _database_entries(ctx, prefix)
    if database:
        # SafeDatabaseScheduler fires its table's rows, the beat_schedule copies among them: the
        # config entry of the same name is a copy that never fires.
        names = {row.name for row in database}
        found = [i for i in found if not (i.source == "config" and i.name in names)]
    problems, _ = _invalid_entries(app)
    if as_json:
        listed = [info.as_dict() for info in found] + [_database_dict(row) for row in database]
        for item in listed:
            item["invalid"] = problems.get(item["name"])
        _dump(listed)
        return
    rows = [("NAME", "SOURCE", "STATE", "SCHEDULE", "NEXT FIRE", "LAST FIRED", "TASK")]
    for i in found:
        state = "enabled" if i.enabled else "paused"
        overlap = (i.options or {}).get("safe_time_overlap")
        if overlap not in (None, "allow"):
            state += f"/{overlap}"
        nxt = i.next_fire.isoformat() if i.next_fire else "-"
        last = i.last_fired.isoformat() if i.last_fired else "-"
        rows.append((i.name, i.source, state, describe_schedule(i.schedule), nxt, last, i.task))
    for row in database:
        state = "enabled" if row.enabled else "paused"
        nxt = row.next_fire.isoformat() if row.next_fire else "-"
        last = row.last_fired.isoformat() if row.last_fired else "-"
        rows.append((row.name, row.source, state, row.schedule, nxt, last, row.task))
    # The leader disables an invalid entry (the others fire): shown so, with the reason below.
    rows = [rows[0], *((r[0], r[1], "invalid" if r[0] in problems else r[2], *r[3:]) for r in rows[1:])]
    _echo_table([rows[0], *sorted(rows[1:], key=lambda r: r[0])])
    count = len(rows) - 1
    click.echo(f"{count} entr{'y' if count == 1 else 'ies'}")
    for name in sorted(problems):
        click.echo(f"invalid: {name}: {problems[name]}")


def _database_entries(ctx: click.Context, prefix: str | None) -> list[Any]:
    """django-celery-beat's rows (``SafeDatabaseScheduler``'s entries), when Django runs with it."""
    app = _loaded_app(ctx)
    from .contrib.django.status import django_beat_in_use

    if not django_beat_in_use():
        return []
    from .clock import local_time, to_datetime
    from .contrib.django.overview import database_rows

    try:
        rows = database_rows(app, to_datetime(local_time()))
    except Exception as exc:  # django-celery-beat installed but its tables not migrated here (as status)
        click.echo(f"django-celery-beat entries unreadable: {exc.__class__.__name__}: {_first_line(exc)}", err=True)
        return []
    return [row for row in rows if prefix is None or row.name.startswith(prefix)]


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
    from .beat.entries import get_entry
    from .beat.history import entry_audit, entry_history

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
    from .beat.entries import cron_spec, describe_schedule, save_entry

    if sum(x is not None for x in (cron, every, at_)) != 1:
        raise click.UsageError("give exactly one of --cron, --every or --at")
    if tz is not None and cron is None:
        raise click.UsageError("--tz goes with --cron")
    args = _json_arg(args_json, "--args", list)
    kwargs = _json_arg(kwargs_json, "--kwargs", dict)
    options = _json_arg(options_json, "--options", dict)
    try:
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
    except _entry_errors() as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{info.name}: {describe_schedule(info.schedule)} -> {info.task} (version {info.version})")


@beat_group.command(name="remove", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
def beat_remove(ctx: click.Context, name: str) -> None:
    """Delete the runtime entry NAME (the leader stops it at its next tick); exit 1 if there is none."""
    from .beat.entries import delete_entry

    try:
        removed = delete_entry(name, app=_app(ctx), changed_by=_changed_by())
    except _entry_errors() as exc:
        raise click.ClickException(str(exc)) from None
    if not removed:
        click.echo(f"no runtime entry {name!r}", err=True)
        sys.exit(1)
    click.echo(f"{name}: removed")


def _set_enabled(ctx: click.Context, name: str, enabled: bool, note: str | None = None, until: Any = None) -> None:
    from .beat.entries import set_enabled

    try:
        info = set_enabled(name, enabled, app=_app(ctx), note=note, until=until, changed_by=_changed_by())
    except _entry_errors() as exc:
        raise click.ClickException(str(exc)) from None
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

    from .beat.entries import run_now, run_now_fired

    app = _app(ctx)
    try:
        slot = run_now(name, app=app, changed_by=_changed_by())
    except _entry_errors() as exc:
        raise click.ClickException(str(exc)) from None
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
    from .beat.backfill import run_backfill

    try:
        result = run_backfill(
            name, _instant(start, "--from"), _instant(end, "--to"), app=_app(ctx), limit=limit,
            changed_by=_changed_by(), overlap=overlap,
        )  # fmt: skip
    except _entry_errors() as exc:
        raise click.ClickException(str(exc)) from None
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
    from .beat.entries import save_entries

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

    try:
        changed = save_entries(items(), app=_loaded_app(ctx), changed_by=_changed_by())
    except _entry_errors() as exc:
        raise click.ClickException(str(exc)) from None
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
    from .beat.redbeat import import_redbeat
    from .exceptions import ImproperlyConfigured

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


# === delays ===================================================================


@safe_time.group(cls=click.Group)
def delays() -> None:
    """Stored delayed tasks: list, show, cancel, reschedule, rerun, purge."""


@delays.command(name="list", cls=CeleryCommand)
@click.option("--status", type=click.Choice(DELAY_STATUSES), default=None, help="Only rows in this state.")
@click.option("--task", default=None, help="Only rows of this task name.")
@click.option("--due-before", default=None, help="Only rows due at or before this ISO time (naive = UTC).")
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def delays_list(
    ctx: click.Context, status: str | None, task: str | None, due_before: str | None, limit: int, as_json: bool
) -> None:
    """Stored delays ordered by due time."""
    from .delays.admin import list_delays

    rows = list_delays(_loaded_app(ctx), status=status, task=task, due_before=due_before, limit=limit)
    if as_json:
        _dump(rows)
        return
    # Debounced rows add a column with their key (task name and rendered key); plain listings keep their shape.
    keyed = any(row.get("debounce_key") for row in rows)
    header: tuple[str, ...] = ("ID", "STATUS", "DUE AT", "TASK", "ATTEMPTS", "STARTS", "OUTCOME")
    table: list[tuple[str, ...]] = [(*header, "DEBOUNCE KEY") if keyed else header]
    for row in rows:
        outcome = f"{row['outcome']} on {row['worker']}" if row.get("outcome") else "-"
        line: tuple[str, ...] = (
            row["id"],
            row["status"],
            row["due_at"].isoformat(),
            row["task"],
            str(row["attempts"]),
            str(row.get("starts", 0)),
            outcome,
        )
        table.append((*line, row.get("debounce_key") or "-") if keyed else line)
    _echo_table(table)
    click.echo(f"{len(rows)} row(s)")


@delays.command(name="show", cls=CeleryCommand)
@click.argument("task_id")
@click.pass_context
def delays_show(ctx: click.Context, task_id: str) -> None:
    """One stored delay with its decoded call; exit 1 if unknown."""
    from .delays.admin import show_delay

    data = show_delay(_loaded_app(ctx), task_id)
    if data is None:
        click.echo(f"no stored delay {task_id}", err=True)
        sys.exit(1)
    _dump(data)


@delays.command(name="cancel", cls=CeleryCommand)
@click.argument("task_id")
@click.pass_context
def delays_cancel(ctx: click.Context, task_id: str) -> None:
    """Cancel a stored delay that has not started; exit 1 when nothing changed."""
    from .delays.admin import cancel

    app = _loaded_app(ctx)
    if cancel(task_id, app=app):
        click.echo(f"{task_id}: cancelled")
        return
    _unchanged(app, task_id, "cancellable")


@delays.command(name="reschedule", cls=CeleryCommand)
@click.argument("task_id")
@click.option("--eta", default=None, help="New due time, ISO 8601 (naive = UTC).")
@click.option("--countdown", type=float, default=None, help="New due time, seconds from the store's now.")
@click.pass_context
def delays_reschedule(ctx: click.Context, task_id: str, eta: str | None, countdown: float | None) -> None:
    """Move a stored delay that has not started (it gets a new delivery token); exit 1 when nothing changed."""
    from .delays.admin import reschedule

    if (eta is None) == (countdown is None):
        raise click.UsageError("give exactly one of --eta or --countdown")
    app = _loaded_app(ctx)
    if reschedule(task_id, eta=eta, countdown=countdown, app=app):
        click.echo(f"{task_id}: rescheduled")
        return
    _unchanged(app, task_id, "reschedulable")


@delays.command(name="rerun", cls=CeleryCommand)
@click.argument("task_ids", metavar="ID...", nargs=-1)
@click.option("--failed", "all_failed", is_flag=True, help="Every failed stored delay (with --task: of that task).")
@click.option("--task", "task_name", default=None, help="With --failed: only this task's rows.")
@click.pass_context
def delays_rerun(ctx: click.Context, task_ids: tuple[str, ...], all_failed: bool, task_name: str | None) -> None:
    """Run failed or expired stored delays again: pending, due now, with a new delivery token (each runs
    once). Exit 1 when a given ID changed nothing."""
    from .delays.admin import rerun, rerun_failed

    if all_failed == bool(task_ids):
        raise click.UsageError("give task ids or --failed (not both)")
    if task_name is not None and not all_failed:
        raise click.UsageError("--task goes with --failed")
    app = _loaded_app(ctx)
    if all_failed:
        done = rerun_failed(app, task=task_name)
        for task_id in done:
            click.echo(f"{task_id}: pending again, due now")
        click.echo(f"{len(done)} failed delays rerun" + (f" (task {task_name})" if task_name else ""))
        return
    unchanged = []
    for task_id in task_ids:
        if rerun(task_id, app=app):
            click.echo(f"{task_id}: pending again, due now")
        else:
            unchanged.append(task_id)
    for task_id in unchanged:
        _unchanged(app, task_id, "failed or expired", exit_code=None)
    if unchanged:
        sys.exit(1)


def _unchanged(app: Celery, task_id: str, what: str, *, exit_code: int | None = 1) -> None:
    """Say why a cancel or reschedule changed nothing (an unknown id is not a finished row), exit 1."""
    from .delays.backends import get_store

    row = get_store(app).get(task_id)
    if row is None:
        click.echo(f"{task_id}: no such delay", err=True)
    else:
        hint = ""
        if row.status in C.DELAY_RERUNNABLE_STATUSES and what == "reschedulable":
            hint = f"; run it again with: celery safe-time delays rerun {task_id}"
        click.echo(f"{task_id}: {row.status}, not {what}, unchanged{hint}", err=True)
    if exit_code is not None:
        sys.exit(exit_code)


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """``--older-than``: seconds as ``3600`` or with a unit (``45s``, ``30m``, ``12h``, ``7d``, ``2w``)."""
    from .config import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _purge_statuses(ctx: click.Context, param: click.Parameter, value: str) -> frozenset[str]:
    """``--status``: a comma-separated subset of the finished statuses (never pending or claimed)."""
    statuses = frozenset(part.strip() for part in value.split(",") if part.strip())
    if not statuses or statuses - PURGEABLE_STATUSES:
        allowed = ",".join(sorted(PURGEABLE_STATUSES))
        raise click.BadParameter(f"{value!r}: give a comma-separated subset of {allowed}", ctx, param)
    return statuses


@delays.command(name="purge", cls=CeleryCommand)
@click.option(
    "--older-than", required=True, callback=_duration, help="Rows last changed longer ago than this: 3600, 12h, 7d."
)
@click.option(
    "--status",
    "statuses",
    callback=_purge_statuses,
    default="sent,cancelled,expired",
    show_default=True,
    help="Comma-separated finished statuses to delete (add failed explicitly).",
)
@click.option("--dry-run", is_flag=True, help="Count the rows that would be deleted, delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def delays_purge(ctx: click.Context, older_than: float, statuses: frozenset[str], dry_run: bool, as_json: bool) -> None:
    """Delete old finished stored delays in short batches; pending and claimed rows are never touched."""
    from .delays.admin import purge_delays

    result = purge_delays(_loaded_app(ctx), older_than=older_than, statuses=statuses, dry_run=dry_run)
    if as_json:
        _dump(result)
        return
    which = ",".join(result["statuses"])
    if dry_run:
        click.echo(f"{result['matched']} row(s) would be deleted ({which}, last changed before {result['before']})")
    else:
        click.echo(f"{result['deleted']} row(s) deleted ({which}, last changed before {result['before']})")


@delays.command(name="upgrade-schema", cls=CeleryCommand)
@click.pass_context
def delays_upgrade_schema(ctx: click.Context) -> None:
    """Add what a newer version needs to the store's table (columns, indexes) now, not at first use."""
    from .delays.backends import get_store

    store = get_store(_app(ctx))
    upgrade = getattr(store, "upgrade_schema", None)
    if upgrade is None:
        click.echo(f"{store.url}: nothing to do here (Django projects run `manage.py migrate`)")
        return
    upgrade()
    click.echo(f"{mask_url(store.url)}: schema up to date")


@safe_time.command(cls=CeleryCommand)
@click.option("--batch", type=int, default=None, help="Rows per claim (default safe_time_sweep_batch).")
@click.pass_context
def sweep(ctx: click.Context, batch: int | None) -> None:
    """Publish due stored delays now (what beat's sweep entry does), print what was done."""
    from .delays.sweep import sweep as run_sweep

    _dump(run_sweep(_loaded_app(ctx), batch=batch).as_dict())


# === locks ====================================================================


@safe_time.group(name="locks")
def locks_group() -> None:
    """Overlap locks and unique task keys: list held ones, release a stuck one."""


@locks_group.command(name="list", cls=CeleryCommand)
@click.option("--pattern", default="*", show_default=True, help="Glob over lock keys, e.g. 'inventory-sync:*'.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def locks_list(ctx: click.Context, pattern: str, as_json: bool) -> None:
    """Held locks and unique keys (found with SCAN): key, holder task id, state, host, age, TTL left."""
    from .locks.admin import list_locks

    found = list_locks(_app(ctx), pattern)
    if as_json:
        _dump([info.as_dict() for info in found])
        return
    if not found:
        click.echo(f"no overlap locks held matching {pattern!r}")
        return
    rows = [("KEY", "TASK ID", "STATE", "HOST", "PID", "FENCE", "AGE", "TTL LEFT")]
    for i in found:
        age = "?" if i.age is None else f"{i.age:.1f}s"
        ttl = "?" if i.ttl_left is None else f"{i.ttl_left:.1f}s"
        state = i.state or ("held" if i.kind == "overlap" else "?")
        pid, fence = ("-", "-") if i.kind == "unique" else (str(i.pid or "?"), str(i.fence or "?"))
        rows.append((i.key, i.task_id or "?", state, i.host or "?", pid, fence, age, ttl))
    _echo_table(rows)


@locks_group.command(name="release", cls=CeleryCommand)
@click.argument("key")
@click.option("--yes", is_flag=True, help="Really delete the lock, whoever holds it.")
@click.pass_context
def locks_release(ctx: click.Context, key: str, yes: bool) -> None:
    """Delete a stuck lock KEY (as 'locks list' shows it). A running holder is told at its next renewal."""
    from .locks.admin import release_lock

    if not yes:
        click.echo(f"refusing to release {key!r} without --yes (its holder may still be running)", err=True)
        sys.exit(2)
    info = release_lock(_app(ctx), key)
    if info is None:
        click.echo(f"no lock held for {key!r}")
        sys.exit(1)
    if info.kind == "unique":
        click.echo(f"released {info.key} (held by {info.task_id}, {info.state}, from {info.host})")
        return
    click.echo(f"released {info.key} (held by {info.task_id} on {info.host}, pid {info.pid}, fence {info.fence})")
