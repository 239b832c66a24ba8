"""The SQL store's conditions and the delivery record's conditional writes, as SQLAlchemy Core statements."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from .... import constants as C
from ..base import started_values
from .schema import delays, status_is

#: "Now" in a statement: the store's time read before it, or the database's clock inside it.
Now = datetime | sa.ColumnElement[Any]


def _ago(now: Now, seconds: float) -> Any:
    if isinstance(now, datetime):
        return now - timedelta(seconds=seconds)
    return now - sa.literal(timedelta(seconds=seconds), sa.Interval())


def stale_heartbeat(now: Now, stale_after: float) -> sa.ColumnElement[bool]:
    t = delays
    return sa.or_(t.c.heartbeat_at.is_(None), t.c.heartbeat_at < _ago(now, stale_after))


def suspect(now: Now, stale_after: float) -> sa.ColumnElement[bool]:
    """Started, heartbeat stale, not suspected since its last heartbeat (see ``DelayRow.suspected_at``)."""
    t = delays
    return sa.and_(
        status_is(C.STATUS_STARTED),
        stale_heartbeat(now, stale_after),
        sa.or_(t.c.suspected_at.is_(None), t.c.heartbeat_at > t.c.suspected_at),
    )


def dead(now: Now, stale_after: float) -> sa.ColumnElement[bool]:
    """Suspected more than ``stale_after`` ago, with no heartbeat since."""
    t = delays
    return sa.and_(
        status_is(C.STATUS_STARTED),
        t.c.suspected_at < _ago(now, stale_after),
        sa.or_(t.c.heartbeat_at.is_(None), t.c.heartbeat_at <= t.c.suspected_at),
    )


def looked_away(now: Now, looked_within: float) -> sa.ColumnElement[bool]:
    """Suspected, with no heartbeat since, and not looked at for ``looked_within`` seconds: the store
    (or every sweep) was out of reach meanwhile, so the suspicion starts over (see ``DelayStore.end_stale``)."""
    t = delays
    if not math.isfinite(looked_within):
        return sa.false()
    return sa.and_(
        status_is(C.STATUS_STARTED),
        t.c.suspected_at.is_not(None),
        sa.or_(t.c.heartbeat_at.is_(None), t.c.heartbeat_at <= t.c.suspected_at),
        t.c.updated_at < _ago(now, looked_within),
    )


def older(before: datetime, statuses: frozenset[str]) -> sa.ColumnElement[bool]:
    """Rows of ``statuses`` last changed before ``before``: what a purge deletes."""
    # Inlined statuses, as in status_is(): PostgreSQL then proves the partial index's predicate.
    wanted = [sa.literal(s, literal_execute=True) for s in sorted(statuses)]
    return sa.and_(delays.c.status.in_(wanted), delays.c.updated_at < before)


def bind(name: str, type_: Any = None) -> sa.BindParameter[Any]:
    """A value given at each run of a statement compiled once (:class:`RecordWrites`)."""
    return sa.bindparam(name, type_=type_, required=False)


def start_update(
    task_id: Any,
    token: Any,
    run_id: Any,
    worker: Any,
    now: Now,
    stale_after: float,
    takeover: sa.ColumnElement[bool] | None,
    starts: sa.ColumnElement[Any],
    leeway: float = math.inf,
) -> sa.Update:
    """The conditional start that decides the one run: a row not started yet, or a started one whose run
    is dead or matches ``takeover`` (run ids of this delivery's earlier copies).

    Values are Python values or binds (:func:`bind`). ``starts`` is the new start count: MySQL applies
    SET assignments left to right, so an expression there that reads ``started_by`` would see the new one.
    """
    t = delays
    taken_over = sa.or_(dead(now, stale_after), *([takeover] if takeover is not None else []))
    unstarted: sa.ColumnElement[bool] = t.c.status.in_(sorted(C.DELAY_STARTABLE_STATUSES))
    if math.isfinite(leeway):
        # Not before it is due by the store's clock: a message published ahead with its eta reaches
        # a worker whose clock is fast too soon.
        unstarted = sa.and_(unstarted, t.c.due_at <= _ago(now, -leeway))
    return (
        sa.update(t)
        .where(
            t.c.id == task_id,
            t.c.delivery_token == token,
            sa.or_(unstarted, sa.and_(status_is(C.STATUS_STARTED), taken_over)),
        )
        .values(**started_values(now, worker, run_id), starts=starts, updated_at=now)
    )


def _running(task_id: Any, token: Any, run_id: Any) -> sa.ColumnElement[bool]:
    t = delays
    return sa.and_(
        t.c.id == task_id, t.c.delivery_token == token, status_is(C.STATUS_STARTED), t.c.started_by == run_id
    )


def heartbeat_update(task_id: Any, token: Any, run_id: Any, now: Now) -> sa.Update:
    return sa.update(delays).where(_running(task_id, token, run_id)).values(heartbeat_at=now)


def finish_update(task_id: Any, token: Any, run_id: Any, now: Now, outcome: Any, last_error: Any) -> sa.Update:
    """The end of the run ``run_id``; ``last_error`` None keeps the column as it is."""
    values: dict[str, Any] = {"status": C.STATUS_FINISHED, "outcome": outcome, "finished_at": now, "updated_at": now}
    if last_error is not None:
        values["last_error"] = last_error
    return sa.update(delays).where(_running(task_id, token, run_id)).values(**values)


def hand_back_update(task_id: Any, token: Any, run_id: Any, now: Now) -> sa.Update:
    """The run ``run_id`` gave its message back to the broker: startable again by that message."""
    values = {"status": C.STATUS_SENT, "sent_at": now, "suspected_at": None, "updated_at": now}
    return sa.update(delays).where(_running(task_id, token, run_id)).values(**values)
