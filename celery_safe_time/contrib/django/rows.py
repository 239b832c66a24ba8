"""django-celery-beat's ``PeriodicTask`` rows as beat entries: the schedule ``SafeDatabaseScheduler``
fires a row on, and a row's definition as the change audit records it. Plain attribute reads: no
query beyond the row's schedule relation, usable on unsaved rows."""

from __future__ import annotations

import json
from typing import Any

from ...beat.entries import definition_json, schedule_to_spec
from ...exceptions import ScheduleError

__all__ = ["row_definition", "row_schedule"]

#: Publish options of a row, as ``ModelEntry`` hands them to ``apply_async``.
_OPTION_FIELDS = ("queue", "exchange", "routing_key", "priority", "expire_seconds")


def _loads(text: Any) -> Any:
    if text is None or text == "":
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text  # kept as written: the scheduler refuses such a row too


def row_schedule(row: Any) -> Any:
    """The schedule ``SafeDatabaseScheduler`` fires a row on: its crontab in the row's own timezone
    (with the DST rules), else django-celery-beat's schedule object (raises for a row without one)."""
    from celery.schedules import crontab as celery_crontab

    from ...schedules import crontab

    schedule = row.schedule
    if isinstance(schedule, celery_crontab) and getattr(row, "crontab", None) is not None:
        return crontab.from_celery(schedule, tz=row.crontab.timezone or "UTC")
    return schedule


def _spec(row: Any) -> dict[str, Any]:
    try:
        schedule = row_schedule(row)
    except Exception as exc:  # no schedule row (deleted under it), a broken one
        return {"type": "none", "error": f"{exc.__class__.__name__}: {exc}"}
    clocked_time = getattr(schedule, "clocked_time", None)  # django-celery-beat's ClockedSchedule
    if clocked_time is not None:
        return {"type": "at", "at": clocked_time.isoformat()}
    try:
        return schedule_to_spec(schedule)
    except ScheduleError:
        return {"type": "unsupported", "text": str(schedule)}


def row_definition(row: Any) -> dict[str, Any]:
    """A ``PeriodicTask`` row as an audit definition: the runtime entries' definition JSON
    (name, task, schedule, args, kwargs, options, enabled), the row's publish options and headers
    in ``options``, and its own fields where set (``one_off``, ``start_time``, ``description``)."""
    args, kwargs = _loads(row.args), _loads(row.kwargs)
    # arguments the scheduler cannot run either (not a JSON array / object) are kept, wrapped, so
    # the record still shows what was written
    options: dict[str, Any] = {f: getattr(row, f) for f in _OPTION_FIELDS if getattr(row, f, None) is not None}
    if row.expires is not None:
        options["expires"] = row.expires.isoformat()
    headers = _loads(row.headers)
    if headers:
        options["headers"] = headers
    body: dict[str, Any] = json.loads(
        definition_json(
            row.name,
            row.task,
            _spec(row),
            args if isinstance(args, list) else ([] if args is None else [args]),
            kwargs if isinstance(kwargs, dict) else ({} if kwargs is None else {"": kwargs}),
            options,
            bool(row.enabled),
        )
    )
    if row.one_off:
        body["one_off"] = True
    if row.start_time is not None:
        body["start_time"] = row.start_time.isoformat()
    if row.description:
        body["description"] = row.description
    return body
