"""``safe-time check`` and ``safe-time status``: every capability at once, and the probes behind them."""

from __future__ import annotations

import sys
from typing import Any

import click
from celery import Celery
from celery.bin.base import CeleryCommand

from .. import constants as C
from ..checks import (
    PROBES,
    beat_verdict,
    beats_verdict,
    default_max_lateness,
    run_checks,
    shards_verdict,
    sweep_verdict,
    unreachable,
    worst,
)
from ..config import get_config, mask_url
from ..health import Check, error_text
from .base import _MARK, _app, _dump, _duration, _first_line, _loaded_app, safe_time


@safe_time.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Check clocks, Redis and the store; exit 1 on any failure (usable as a probe)."""
    from ..config import log_setting_warnings

    # The settings warnings are rows of the report here, not log lines beside it.
    log_setting_warnings(False)
    try:
        checks = run_checks(_loaded_app(ctx))
    finally:
        log_setting_warnings(True)
    if not any(c.name == "settings" and c.status == "fail" for c in checks):
        checks.extend(_shard_checks(_app(ctx)))
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
    from ..beat.entry_pages import invalid_entries
    from ..contrib.django.status import django_beat_in_use

    try:
        problems = invalid_entries(app)
    except Exception as exc:  # the beat backend unreachable: the other rows of check say why
        return {}, f"beat entries unreadable: {exc.__class__.__name__}: {_first_line(exc)}"
    if django_beat_in_use():
        from ..contrib.django.schedulers import invalid_rows

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


def _shard_checks(app: Celery) -> list[Check]:
    """``check``'s row for sharded firing: the live beats' ``safe_time_beat_shards`` agree (shown when the
    app shards, or when a live beat shards beside an app that does not)."""
    from ..beat.admin import beat_rows
    from ..beat.backends import beat_backend

    config = get_config(app)
    backend = beat_backend(config)
    errors: tuple[type[Exception], ...] = (*backend.errors, OSError)
    try:
        beats = beat_rows(backend)
    except errors as exc:  # the backend's own row says it is unreachable; this one only when sharding
        if config.beat_shards <= 1:
            return []
        return [Check("beat shards", "warn", f"beat heartbeats unreadable: {error_text(exc)}")]
    if config.beat_shards <= 1 and all(beat["shards_setting"] == 1 for beat in beats):
        return []  # one leader, and every live beat agrees: nothing to say
    return [beats_verdict(config.beat_shards, beats)]


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
    """A leader holds the lease; with shards, a beat holds every shard."""
    from ..beat.admin import shard_rows
    from ..beat.backends import beat_backend

    config = get_config(app)
    backend = beat_backend(config)
    errors: tuple[type[Exception], ...] = (*backend.errors, OSError)
    try:
        view = backend.lease_view()
        rows = shard_rows(backend) if config.beat_shards > 1 else None
    except errors as exc:
        return Check(
            "beat", "fail", f"{backend.label} {backend.where().split(' ', 1)[-1]} unreachable: {error_text(exc)}"
        )
    if rows is not None:
        return shards_verdict(rows)
    return beat_verdict(view.ttl_ms, view.info, view.epoch)


def probe_store(app: Celery) -> Check:
    from ..delays.backends import get_store

    url = mask_url(get_config(app).store_url)
    try:
        get_store(app).ping()
    except Exception as exc:  # a probe reports every failure, whatever the driver raises
        return Check("store", "fail", unreachable(url, exc))
    return Check("store", "ok", f"{url} reachable", value=url)


def probe_sweep(app: Celery, max_lateness: float | None = None) -> Check:
    from ..delays.backends import get_store

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
    from ..contrib.django.status import describe_beat_with_django
    from ..delays.admin import describe_delays
    from ..locks.admin import describe_flow, describe_locks

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
