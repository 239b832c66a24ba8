"""A stored call that never runs (expired, cancelled, revoked) reports what Celery's worker would.

Celery's worker marks a message it discards as expired or revoked ``REVOKED`` in the result backend
(``TaskRevokedError('expired' | 'revoked')``) and, for a member of a chord's header, counts it as a
part of the chord that failed, so the chord's callback fails with
``ChordError("Dependency ... raised TaskRevokedError(...)")`` (``Request._announce_revoked``,
``Backend.mark_as_revoked``). A stored call that ends in the store is never seen by a worker, so the
process that closes its row (the sweep, ``cancel``) reports it here, with the request the worker
would have built from the stored options: its chord, group and group index, root and parent ids.
Like Celery's, the report calls no ``link_error`` of the task itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery import Celery, states
from celery.app.task import Context
from celery.signals import task_revoked

from ..config import get_config
from ..exceptions import SafeTimeError
from .backends.base import DelayRow
from .payload import decode

logger = logging.getLogger(__name__)

#: The reasons Celery's worker gives (``TaskRevokedError(reason)``).
REASON_EXPIRED = "expired"
REASON_REVOKED = "revoked"


def stored_request(app: Celery, row: DelayRow) -> Context:
    """The request a worker would have built from the row's message (what the result backend reads)."""
    body = decode(row.payload, row.content_type, row.content_encoding, allow_pickle=get_config(app).allow_pickle)
    options: dict[str, Any] = dict(body.get("options") or {})
    headers = dict(options.get("headers") or {})
    stamped = options.get("stamped_headers")
    return Context(
        id=row.id,
        task=row.task,
        args=list(body.get("args") or ()),
        kwargs=dict(body.get("kwargs") or {}),
        group=options.get("group_id"),
        group_index=options.get("group_index"),
        chord=options.get("chord"),
        chain=options.get("chain"),
        callbacks=options.get("link"),
        errbacks=options.get("link_error"),
        # As Celery's message: a call made outside any task is its own root.
        root_id=options.get("root_id") or row.id,
        parent_id=options.get("parent_id"),
        retries=int(options.get("retries") or 0),
        ignore_result=bool(options.get("ignore_result", False)),
        headers=headers,
        stamped_headers=stamped,
        stamps={name: options.get(name) for name in stamped or ()},
        delivery_info={
            "exchange": options.get("exchange"),
            "routing_key": options.get("routing_key") or options.get("queue"),
            "priority": options.get("priority"),
        },
        is_eager=False,
    )


def report_revoked(
    app: Celery, rows: Iterable[DelayRow], reason: str, *, expired: bool = False, unless_recorded: bool = False
) -> int:
    """Mark each row's task ``REVOKED`` with ``reason`` in its result backend, as Celery's worker does
    with a message it discards; a chord member also counts as a failed part of its chord.

    Call it once per row, after the store closed the row (so two processes never report one row).
    ``unless_recorded``: skip a row whose task already has a finished state (a published row whose
    expired message a worker discarded, and reported, itself): a chord must count each part once.
    A result backend that fails is logged, never raised: the row is closed either way. Returns how
    many rows were reported.
    """
    reported = 0
    for row in rows:
        task = app.tasks.get(row.task)
        backend = task.backend if task is not None else app.backend
        if unless_recorded and _recorded(backend, row.id):
            continue
        try:
            request = stored_request(app, row)
            store_result = not request.ignore_result or bool(getattr(task, "store_errors_even_if_ignored", False))
            backend.mark_as_revoked(row.id, reason, request=request, store_result=store_result)
        except SafeTimeError as exc:
            logger.warning("stored task %s[%s] %s; cannot report it: %s", row.task, row.id, reason, exc)
            continue
        except Exception as exc:  # the result backend's own errors: the row is closed all the same
            logger.warning(
                "stored task %s[%s] %s; the result backend did not take its REVOKED state: %s: %s",
                row.task,
                row.id,
                reason,
                exc.__class__.__name__,
                exc,
            )
            continue
        reported += 1
        if task is not None:
            task_revoked.send(sender=task, request=request, terminated=False, signum=None, expired=expired)
    return reported


def _recorded(backend: Any, task_id: str) -> bool:
    """Whether the result backend already holds a finished state for ``task_id`` (False when unsure)."""
    try:
        return backend.get_state(task_id) in states.READY_STATES
    except Exception:  # a backend without results (DisabledBackend) or one that is down: report
        return False
