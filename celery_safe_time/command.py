"""``celery -A proj safe-time ...``: the operator's command (a ``celery.commands`` plugin)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from celery import Celery
from celery.bin.base import CeleryCommand, CLIContext, handle_preload_options

from .checks import Check, run_checks, worst

_MARK = {"ok": ("OK", "green"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "red")}


def _app(ctx: click.Context) -> Celery:
    obj: CLIContext = ctx.obj
    app: Celery = obj.app
    return app


def _dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, sort_keys=True))


@click.group(name="safe-time")
@click.pass_context
@handle_preload_options
def safe_time(ctx: click.Context, **kwargs: Any) -> None:
    """celery-safe-time: single-leader beat, durable delays, overlap locks."""


@safe_time.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Check clocks, Redis and the store; exit 1 on any failure (usable as a probe)."""
    checks = run_checks(_app(ctx))
    overall = worst(checks)
    if as_json:
        _dump({"status": overall, "checks": [c.as_dict() for c in checks]})
    else:
        _print_checks(ctx, checks)
        label, color = _MARK[overall]
        click.echo("overall: " + ctx.obj.style(label, fg=color, bold=True))
    sys.exit(1 if overall == "fail" else 0)


def _print_checks(ctx: click.Context, checks: list[Check]) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        label, color = _MARK[c.status]
        click.echo(f"{ctx.obj.style(f'{label:<4}', fg=color, bold=True)}  {c.name:<{width}}  {c.detail}")
