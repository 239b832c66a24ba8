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


@safe_time.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Beat leader, stored delays and held overlap locks."""
    app = _app(ctx)
    sections = {name: describe(app) for name, describe in _status_sections()}
    if as_json:
        _dump(sections)
        return
    for name, data in sections.items():
        click.echo(ctx.obj.style(f"[{name}]", bold=True))
        _print_tree(data, indent=2)


def _status_sections() -> list[tuple[str, Any]]:
    """(title, describe(app) -> dict) pairs, one per feature, imported lazily."""
    sections: list[tuple[str, Any]] = []
    # --- status: beat ----------------------------------------------------------
    from .scheduler import describe_beat

    sections.append(("beat", describe_beat))

    # --- status: delays --------------------------------------------------------

    # --- status: locks ---------------------------------------------------------

    return sections


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


# === beat commands (issue 3) =====================================================


# === delays commands (issue 4) ===================================================


# === locks commands (issue 5) ====================================================
