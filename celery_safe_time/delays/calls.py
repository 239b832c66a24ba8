"""``cancel`` and ``reschedule``: operate on stored delayed tasks by task id."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from celery import Celery, current_app

from . import signals
from .delay_payload import as_aware_utc
from .stores import get_store

logger = logging.getLogger(__name__)


def _app(app: Celery | None) -> Celery:
    return app if app is not None else current_app._get_current_object()


def cancel(task_id: str, *, app: Celery | None = None) -> bool:
    """Cancel a pending stored task: it will never be published. True when a pending row changed."""
    store = get_store(_app(app))
    changed = store.cancel(task_id)
    if changed:
        logger.info("cancelled stored task %s", task_id)
        signals.delay_cancelled.send(sender=store, task_id=task_id)
    return changed


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
    store = get_store(_app(app))
    due_at = as_aware_utc(eta) if eta is not None else store.now() + timedelta(seconds=float(countdown or 0))
    changed = store.reschedule(task_id, due_at)
    if changed:
        logger.info("rescheduled stored task %s to %s", task_id, due_at.isoformat())
    return changed
