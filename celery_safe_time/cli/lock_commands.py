"""``safe-time locks ...``: held overlap locks and unique task keys."""

from __future__ import annotations

import sys

import click
from celery.bin.base import CeleryCommand

from .base import _app, _dump, _echo_table, safe_time


@safe_time.group(name="locks")
def locks_group() -> None:
    """Overlap locks and unique task keys: list held ones, release a stuck one."""


@locks_group.command(name="list", cls=CeleryCommand)
@click.option("--pattern", default="*", show_default=True, help="Glob over lock keys, e.g. 'inventory-sync:*'.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def locks_list(ctx: click.Context, pattern: str, as_json: bool) -> None:
    """Held locks and unique keys (found with SCAN): key, holder task id, state, host, age, TTL left."""
    from ..locks.admin import list_locks

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
    from ..locks.admin import release_lock

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
