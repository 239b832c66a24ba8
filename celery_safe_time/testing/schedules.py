"""When beat fires a schedule, computed without running beat."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime, timezone, tzinfo
from typing import Any

from celery import Celery

from ..clock import as_utc, local_time, to_datetime

UTC = timezone.utc


def next_fires(
    schedule_or_entry: Any,
    n: int = 5,
    after: datetime | None = None,
    *,
    app: Celery | None = None,
    tz: str | tzinfo | None = None,
) -> list[datetime]:
    """The next ``n`` instants (aware UTC) at which beat fires this schedule or entry, DST rules included.

    Takes a schedule (``celery_safe_time.crontab``, Celery's ``crontab``, a number of seconds, a
    ``timedelta``, a ``schedule``), a ``beat_schedule`` dict entry, or anything with ``.schedule``.
    A plain Celery crontab is read in ``tz``, else ``app.timezone``, else UTC, as beat reads it in
    the app's timezone. ``after`` (naive = UTC) defaults to now. An interval's grid starts where beat
    first sees the entry: the first fire is ``after`` (rounded up to a second), then every interval.
    """
    from ..beat.slots import grid_for
    from ..schedules import resolve_tz

    schedule = schedule_or_entry
    if isinstance(schedule, Mapping):
        schedule = schedule["schedule"]
    elif hasattr(schedule, "schedule") and not hasattr(schedule, "remaining_estimate"):
        schedule = schedule.schedule
    if tz is not None:
        zone = resolve_tz(tz)
    elif app is not None:
        zone = app.timezone
    else:
        zone = UTC
    start = as_utc(after).timestamp() if after is not None else local_time()
    grid = grid_for(schedule, zone)
    fires: list[datetime] = []
    slot = grid.first(start)
    for _ in range(n):
        if not math.isfinite(slot):
            break
        fires.append(to_datetime(slot))
        slot = grid.next(slot)
    return fires
