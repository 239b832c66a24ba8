"""``safe-time delays ...`` and ``safe-time sweep``: the stored delayed tasks."""

from __future__ import annotations

import sys

import click
from celery import Celery
from celery.bin.base import CeleryCommand

from .. import constants as C
from ..constants import DELAY_STATUSES, PURGEABLE_STATUSES
from .base import _dump, _duration, _echo_table, _loaded_app, safe_time


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
    from ..delays.admin import list_delays

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
    from ..delays.admin import show_delay

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
    from ..delays.admin import cancel

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
    from ..delays.admin import reschedule

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
    from ..delays.admin import rerun, rerun_failed

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
    from ..delays.backends import get_store

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
    from ..delays.admin import purge_delays

    result = purge_delays(_loaded_app(ctx), older_than=older_than, statuses=statuses, dry_run=dry_run)
    if as_json:
        _dump(result)
        return
    which = ",".join(result["statuses"])
    if dry_run:
        click.echo(f"{result['matched']} row(s) would be deleted ({which}, last changed before {result['before']})")
    else:
        click.echo(f"{result['deleted']} row(s) deleted ({which}, last changed before {result['before']})")


@safe_time.command(cls=CeleryCommand)
@click.option("--batch", type=int, default=None, help="Rows per claim (default safe_time_sweep_batch).")
@click.pass_context
def sweep(ctx: click.Context, batch: int | None) -> None:
    """Publish due stored delays now (what beat's sweep entry does), print what was done."""
    from ..delays.sweep import sweep as run_sweep

    _dump(run_sweep(_loaded_app(ctx), batch=batch).as_dict())
