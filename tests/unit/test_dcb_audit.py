"""The audit of django-celery-beat rows: which action a pair of definitions is, and a row's definition
(pure functions on plain objects: no Django, no services)."""

from __future__ import annotations

import types
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_interval

from celery_safe_time.contrib.django.audit import change_action
from celery_safe_time.contrib.django.rows import row_definition

UTC = timezone.utc


def _row(**fields: Any) -> Any:
    values: dict[str, Any] = {
        "name": "tenant-1",
        "task": "reports.send",
        "schedule": celery_interval(timedelta(minutes=5)),
        "crontab": None,
        "args": "[1]",
        "kwargs": "{}",
        "queue": None,
        "exchange": None,
        "routing_key": None,
        "priority": None,
        "expire_seconds": None,
        "expires": None,
        "headers": None,
        "enabled": True,
        "one_off": False,
        "start_time": None,
        "description": "",
        # the scheduler's bookkeeping: never part of the definition
        "last_run_at": datetime(2026, 3, 1, tzinfo=UTC),
        "total_run_count": 3,
    }
    values.update(fields)
    return types.SimpleNamespace(**values)


def test_actions_between_definitions() -> None:
    base = row_definition(_row())
    assert change_action(None, base) == "create"
    assert change_action(base, None) == "delete"
    assert change_action(None, None) is None
    assert change_action(base, row_definition(_row(total_run_count=9, last_run_at=None))) is None
    assert change_action(base, row_definition(_row(enabled=False))) == "disable"
    assert change_action(row_definition(_row(enabled=False)), base) == "enable"
    assert change_action(base, row_definition(_row(enabled=False, args="[2]"))) == "update"
    assert change_action(base, row_definition(_row(name="tenant-2"))) == "update"


def test_a_row_definition_is_the_runtime_entry_shape_with_the_rows_own_fields() -> None:
    row = _row(
        schedule=celery_crontab(minute="0", hour="9"),
        crontab=types.SimpleNamespace(timezone="Europe/Berlin"),
        queue="reports",
        priority=5,
        headers='{"safe_time_jitter": 30}',
        expires=datetime(2026, 4, 1, tzinfo=UTC),
        one_off=True,
        description="monthly",
    )
    assert row_definition(row) == {
        "format": 1,
        "name": "tenant-1",
        "task": "reports.send",
        "schedule": {
            "type": "crontab",
            "minute": "0",
            "hour": "9",
            "day_of_week": "*",
            "day_of_month": "*",
            "month_of_year": "*",
            "tz": "Europe/Berlin",
        },
        "args": [1],
        "kwargs": {},
        "options": {
            "queue": "reports",
            "priority": 5,
            "expires": "2026-04-01T00:00:00+00:00",
            "headers": {"safe_time_jitter": 30},
        },
        "enabled": True,
        "one_off": True,
        "description": "monthly",
    }


def test_a_clocked_or_missing_schedule_and_broken_arguments_still_give_a_definition() -> None:
    when = datetime(2026, 5, 1, 12, tzinfo=UTC)
    clocked = row_definition(_row(schedule=types.SimpleNamespace(clocked_time=when)))
    assert clocked["schedule"] == {"type": "at", "at": "2026-05-01T12:00:00+00:00"}

    class NoSchedule:
        name, task, crontab = "orphan", "reports.send", None
        args = kwargs = headers = queue = exchange = routing_key = priority = expire_seconds = expires = None
        enabled, one_off, start_time, description = False, False, None, ""

        @property
        def schedule(self) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'schedule'")

    orphan = row_definition(NoSchedule())
    assert orphan["schedule"]["type"] == "none"
    assert orphan["args"] == []
    assert orphan["kwargs"] == {}
    broken = row_definition(_row(args="not json", kwargs="[1]"))
    assert broken["args"] == ["not json"]
    assert broken["kwargs"] == {"": [1]}
