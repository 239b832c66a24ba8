"""How ``SafeDatabaseScheduler``'s index reads a row's times on MySQL and SQLite: their drivers hand a
plain cursor naive datetimes (or ISO strings), in UTC with ``USE_TZ`` and in ``TIME_ZONE`` without it;
PostgreSQL gives POSIX seconds straight from the query."""

from __future__ import annotations

import datetime as dt

import pytest
from django.test import override_settings

from celery_safe_time.contrib.django.schedulers import _epoch

UTC = dt.timezone.utc
AT = dt.datetime(2026, 3, 29, 0, 30, tzinfo=UTC)  # half an hour before Europe's spring-forward change


@pytest.mark.parametrize(
    "value",
    [AT, AT.replace(tzinfo=None), "2026-03-29 00:30:00", "2026-03-29T00:30:00+00:00"],
    ids=["aware", "naive-utc", "sqlite-text", "iso-offset"],
)
def test_row_times_read_as_utc_with_use_tz(value: object) -> None:
    with override_settings(USE_TZ=True):
        assert _epoch(value) == AT.timestamp()


def test_naive_row_times_read_in_time_zone_without_use_tz() -> None:
    with override_settings(USE_TZ=False, TIME_ZONE="Europe/Paris"):
        # 01:30 in Paris (UTC+1 before the change) is 00:30 UTC
        assert _epoch(dt.datetime(2026, 3, 29, 1, 30)) == AT.timestamp()


def test_a_missing_time_stays_missing() -> None:
    assert _epoch(None) is None
