"""Whether a call is stored or sent: the delay threshold rule (pure: "now" is passed in)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ..clock import as_utc


@dataclasses.dataclass(frozen=True)
class DelayPlan:
    """How a call is delayed: by ``countdown`` seconds from the store's now, or until ``eta``."""

    countdown: float | None = None
    eta: datetime | None = None


def plan_delay(countdown: Any, eta: Any, *, now: datetime, threshold: float) -> DelayPlan | None:
    """Return a plan when the delay is beyond ``threshold`` seconds, else None (go to the broker).

    As in Celery, ``countdown`` wins over ``eta``; a past eta or a short delay returns None so
    the broker gets the call exactly as plain Celery would send it.
    """
    if countdown is not None:
        seconds = float(countdown)
        return DelayPlan(countdown=seconds) if seconds > threshold else None
    if eta is not None:
        when = as_utc(eta)
        return DelayPlan(eta=when) if (when - now).total_seconds() > threshold else None
    return None
