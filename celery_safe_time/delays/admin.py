"""Operations on stored delays by task id: ``cancel`` and ``reschedule`` (public API), and the
operator's views of the store (list, show one decoded, purge, the status summary)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

from celery import Celery, current_app

from .. import constants as C
from .. import signals
from ..clock import as_utc
from ..config import get_config, instant_argument, mask_url, seconds_argument
from ..exceptions import SafeTimeError
from .backends import get_store
from .backends.base import DelayRow, DelayStore
from .payload import decode
from .revoked import REASON_REVOKED, report_revoked

logger = logging.getLogger(__name__)

__all__ = [
    "cancel",
    "describe_delays",
    "list_delays",
    "purge_delays",
    "report_cancelled",
    "rerun",
    "rerun_failed",
    "reschedule",
    "show_delay",
]


def _app(app: Celery | None) -> Celery:
    return app if app is not None else current_app._get_current_object()


def cancel(task_id: str, *, app: Celery | None = None) -> bool:
    """Cancel a stored task that has not started: it will never run, and its result reports
    ``REVOKED`` (``TaskRevokedError('revoked')``; a chord it belongs to fails), as a revoked Celery
    task does. True when a row changed (a second cancel changes and reports nothing)."""
    app = _app(app)
    store = get_store(app)
    changed = store.cancel(task_id)
    if changed:
        logger.info("cancelled stored task %s", task_id)
        signals.delay_cancelled.send(sender=store, task_id=task_id)
        report_cancelled(app, store, task_id)
    return changed


def report_cancelled(app: Celery, store: DelayStore, task_id: str) -> None:
    """What follows a row's cancel, wherever it was cancelled (``cancel``, the Django admin): its
    task reports ``REVOKED`` and a unique task's key is freed."""
    try:
        row = store.get(task_id)
    except SafeTimeError as exc:
        logger.warning("cancelled stored task %s; cannot read it back to report it revoked: %s", task_id, exc)
        return
    if row is not None:
        report_revoked(app, [row], REASON_REVOKED)
        _release_unique(app, row)


def _release_unique(app: Celery, row: DelayRow) -> None:
    """A cancelled row of a unique task frees its key now (a later caller would see it gone anyway)."""
    from ..locks.unique import release_stored

    task_id = row.id
    try:
        body = decode(row.payload, row.content_type, row.content_encoding, allow_pickle=get_config(app).allow_pickle)
        headers = (body.get("options") or {}).get("headers")
        release_stored(app, task_id, headers if isinstance(headers, dict) else None)
    except SafeTimeError as exc:
        logger.warning("cancelled stored task %s; its unique key (if any) expires on its own: %s", task_id, exc)


def reschedule(
    task_id: str,
    *,
    eta: datetime | str | None = None,
    countdown: float | None = None,
    app: Celery | None = None,
) -> bool:
    """Move a pending stored task to ``eta`` (naive = UTC) or ``countdown`` seconds from the store's now.

    Earlier or later both work; a time in the past makes it due at the next sweep. True when a
    pending row changed.
    """
    if (eta is None) == (countdown is None):
        raise TypeError("reschedule() takes exactly one of eta= or countdown=")
    # Checked before the store is asked: a bad value names its parameter and changes nothing.
    when = instant_argument("eta", eta) if eta is not None else None
    seconds = seconds_argument("countdown", countdown) if countdown is not None else 0.0
    store = get_store(_app(app))
    due_at = when if when is not None else store.now() + timedelta(seconds=seconds)
    changed = store.reschedule(task_id, due_at)
    if changed:
        logger.info("rescheduled stored task %s to %s", task_id, due_at.isoformat())
    return changed


def rerun(task_id: str, app: Celery | None = None) -> bool:
    """Run a failed or expired stored task again: its row goes back to pending, due now, with a new
    delivery token and no expiry, and the sweep publishes it once. True when a row changed."""
    store = get_store(_app(app))
    changed = store.rerun(task_id)
    if changed:
        logger.info("stored task %s is pending again, due now", task_id)
    return changed


def rerun_failed(app: Celery, *, task: str | None = None, batch: int = C.PURGE_BATCH) -> list[str]:
    """:func:`rerun` every failed row (of ``task`` only, when given); returns the ids that changed."""
    store = get_store(app)
    done: list[str] = []
    while True:
        rows = store.list(status=C.STATUS_FAILED, task=task, limit=batch)
        changed = [row.id for row in rows if store.rerun(row.id)]
        done.extend(changed)
        # Rerun rows leave the failed ones; a batch that changed nothing (raced away) ends it too.
        if len(rows) < batch or not changed:
            break
    if done:
        logger.info("%d failed stored tasks are pending again, due now", len(done))
    return done


def list_delays(
    app: Celery,
    *,
    status: str | None = None,
    task: str | None = None,
    due_before: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    rows = get_store(app).list(
        status=status,
        task=task,
        due_before=as_utc(due_before) if due_before else None,
        limit=limit,
    )
    return [row.summary() for row in rows]


def purge_delays(
    app: Celery,
    *,
    older_than: float,
    statuses: Collection[str] = C.PURGE_DEFAULT_STATUSES,
    dry_run: bool = False,
    batch: int = C.PURGE_BATCH,
) -> dict[str, Any]:
    """Delete finished rows last changed over ``older_than`` seconds ago, batch by batch until none are left.

    The cutoff is fixed once from the store's clock, so rows that finish meanwhile are not chased.
    """
    store = get_store(app)
    before = store.now() - timedelta(seconds=older_than)
    result: dict[str, Any] = {
        "before": before.isoformat(),
        "statuses": sorted(statuses),
        "dry_run": dry_run,
    }
    if dry_run:
        result["matched"] = store.purgeable(before, statuses)
        return result
    deleted = 0
    while True:
        count = store.purge(before, statuses, batch)
        deleted += count
        if count < batch:
            break
    result["deleted"] = deleted
    return result


def show_delay(app: Celery, task_id: str) -> dict[str, Any] | None:
    row = get_store(app).get(task_id)
    if row is None:
        return None
    data = row.summary()
    try:
        data["call"] = decode(
            row.payload, row.content_type, row.content_encoding, allow_pickle=get_config(app).allow_pickle
        )
    except SafeTimeError as exc:
        data["call_error"] = str(exc)
    return data


def describe_delays(app: Celery) -> dict[str, Any]:
    """The ``safe-time status`` section: pending/claimed counts, oldest due, current lateness."""
    store = get_store(app)
    config = get_config(app)
    info: dict[str, Any] = {"store": mask_url(config.store_url), "namespace": config.store_namespace}
    try:
        counts = store.counts()
        now = store.now()
        oldest = store.oldest_due(C.STATUS_PENDING)
    except SafeTimeError as exc:
        info["error"] = str(exc)
        return info
    info["pending"] = counts[C.STATUS_PENDING]
    info["claimed"] = counts[C.STATUS_CLAIMED]
    info["running"] = counts[C.STATUS_STARTED]
    info["failed"] = counts[C.STATUS_FAILED]
    try:
        info["debounced"] = store.pending_debounced()
    except SafeTimeError as exc:
        info["debounced"] = f"unknown: {exc}"
    info["oldest_due"] = oldest.isoformat() if oldest else None
    # Lateness: how far past due the oldest pending row is (0 when nothing is overdue).
    info["lateness_seconds"] = round(max(0.0, (now - oldest).total_seconds()), 3) if oldest else 0.0
    return info
