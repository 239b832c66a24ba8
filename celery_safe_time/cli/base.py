"""The ``safe-time`` click group and the helpers every command shares: the app, output, errors."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import click
from celery import Celery
from celery.bin.base import CLIContext, handle_preload_options

from ..config import get_config, mask_url

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

        from ..exceptions import RedisUnavailable, StoreError

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


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """``--older-than``, ``--max-lateness``: seconds as ``3600`` or with a unit (``45s``, ``12h``, ``7d``, ``2w``)."""
    from ..config import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@click.group(name="safe-time", cls=SafeTimeGroup)
@click.pass_context
@handle_preload_options
def safe_time(ctx: click.Context, **kwargs: Any) -> None:
    """celery-safe-time: single-leader beat, durable delays, overlap locks."""
