"""Whether a call is stored or sent: the delay threshold rule (pure: "now" is passed in)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ..config import expires_argument, instant_argument, seconds_argument


@dataclasses.dataclass(frozen=True)
class DelayPlan:
    """How a call is delayed: by ``countdown`` seconds from the store's now, or until ``eta``."""

    countdown: float | None = None
    eta: datetime | None = None


def check_call_times(countdown: Any, eta: Any, expires: Any) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``countdown``, ``eta`` or ``expires`` when Celery
    would refuse it (or refuse it only later, in the worker or on a short delay)."""
    if countdown is not None:
        seconds_argument("countdown", countdown)
    if eta is not None:
        instant_argument("eta", eta)
    if expires is not None:
        expires_argument(expires)


def plan_delay(countdown: Any, eta: Any, *, now: datetime, threshold: float) -> DelayPlan | None:
    """Return a plan when the delay is beyond ``threshold`` seconds, else None (go to the broker).

    As in Celery, ``countdown`` wins over ``eta``; a past eta or a short delay returns None so
    the broker gets the call exactly as plain Celery would send it. A ``countdown`` or ``eta`` Celery
    would refuse raises ``TypeError``/``ValueError`` naming it, before anything is stored or sent.
    """
    seconds = None if countdown is None else seconds_argument("countdown", countdown)
    when = None if eta is None else instant_argument("eta", eta)
    if seconds is not None:
        return DelayPlan(countdown=seconds) if seconds > threshold else None
    if when is not None:
        return DelayPlan(eta=when) if (when - now).total_seconds() > threshold else None
    return None


def adaptive_lookahead(
    backlog: int,
    rate: float,
    *,
    base: float,
    ceiling: float,
    limit_reached_in: float | None = None,
    safety: float = 2.0,
    interval: float = 0.0,
) -> float:
    """Seconds ahead of its due time a sweep claims rows, so a backlog due soon is out by its due time.

    ``backlog`` pending rows are due within ``ceiling`` seconds (overdue ones included) and one sweep
    publishes about ``rate`` rows a second: claiming starts ``safety`` times their publishing time
    early, never less than ``base`` nor more than ``ceiling`` (the broker's safe window). When the
    count stopped at its limit (``sweep_max_ahead`` rows), ``limit_reached_in`` is how far ahead the
    last counted row is due: the look-ahead stops there, so the rows beyond it wait (memory). A backlog
    that takes a second or more to publish gets one sweep ``interval`` more: the sweep that first sees
    it inside the look-ahead may come that much later.
    """
    publishing = backlog / max(rate, 1.0)
    needed = base + publishing * safety + (interval if publishing >= 1.0 else 0.0)
    lookahead = min(ceiling, max(base, needed))
    if limit_reached_in is not None:
        lookahead = min(lookahead, max(base, limit_reached_in))
    return lookahead
