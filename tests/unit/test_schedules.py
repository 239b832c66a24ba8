"""DST rules R1-R4 of ``celery_safe_time.crontab`` against a brute-force scan of wall clocks."""

from __future__ import annotations

import datetime as dt
import functools
import pickle
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_safe_time import crontab, next_local
from celery_safe_time.exceptions import ScheduleError

UTC = dt.timezone.utc
YEAR = 2026
ZONES = [
    "America/New_York",
    "Europe/London",
    "Europe/Berlin",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "America/Santiago",
]
FIXED = [("30", "2"), ("0", "0"), ("45", "2"), ("0", "9"), ("30", "1")]
WILDCARD = [("0", "*"), ("30", "*"), ("*/15", "2")]


def _utc(*args: int) -> float:
    return dt.datetime(*args, tzinfo=UTC).timestamp()


@functools.cache
def _scan(zone: str) -> tuple[np.ndarray, np.ndarray]:
    """(utc minute, local wall minute) for every UTC minute of the year +- 3 days.

    Offsets are sampled per hour and located to the minute where they change, which is
    independent of the fold logic under test."""
    tz = ZoneInfo(zone)
    start = int(_utc(YEAR, 1, 1)) // 60 - 3 * 1440
    end = int(_utc(YEAR + 1, 1, 1)) // 60 + 3 * 1440
    utc_min = np.arange(start, end, dtype=np.int64)

    def off(minute: int) -> int:
        delta = dt.datetime.fromtimestamp(minute * 60, tz).utcoffset()
        assert delta is not None
        return int(delta.total_seconds()) // 60

    offsets = np.empty_like(utc_min)
    hour_off = off(start)
    for h in range(0, end - start, 60):
        nxt = off(start + h + 60) if start + h + 60 < end else hour_off
        if nxt == hour_off:
            offsets[h : h + 60] = hour_off
        else:
            for m in range(60):
                offsets[h + m] = off(start + h + m)
        hour_off = nxt
    return utc_min, utc_min + offsets


def _fields(local_min: np.ndarray) -> dict[str, np.ndarray]:
    days = local_min // 1440
    d = days.astype("datetime64[D]")
    month_start = d.astype("datetime64[M]")
    return {
        "minute": local_min % 60,
        "hour": (local_min % 1440) // 60,
        "dom": (d - month_start.astype("datetime64[D]")).astype(np.int64) + 1,
        "month": month_start.astype(np.int64) % 12 + 1,
        "dow": (days + 4) % 7,  # 1970-01-01 was a Thursday; Sunday is 0
    }


def _mask(sched: crontab, local_min: np.ndarray) -> np.ndarray:
    f = _fields(local_min)
    return (
        np.isin(f["minute"], sorted(sched.minute))
        & np.isin(f["hour"], sorted(sched.hour))
        & np.isin(f["dom"], sorted(sched.day_of_month))
        & np.isin(f["month"], sorted(sched.month_of_year))
        & np.isin(f["dow"], sorted(sched.day_of_week))
    )


@functools.cache
def reference(zone: str, minute: str, hour: str, day_of_week: str = "*") -> np.ndarray:
    """Fire instants (UNIX seconds) by brute force over wall clocks, rules R1-R4."""
    sched = crontab(minute, hour, day_of_week, tz=zone)
    utc_min, local_min = _scan(zone)
    if not sched.fixed:  # R3: every real minute whose wall clock matches
        return np.unique(utc_min[_mask(sched, local_min)] * 60)
    walls = np.arange(local_min.min(), local_min.max() + 1, dtype=np.int64)
    walls = walls[_mask(sched, walls)]
    order = np.argsort(local_min, kind="stable")
    sorted_local, sorted_utc = local_min[order], utc_min[order]
    out = []
    for wall in walls:
        lo = np.searchsorted(sorted_local, wall, "left")
        hi = np.searchsorted(sorted_local, wall, "right")
        if hi > lo:  # exists (once or twice): first occurrence (R2)
            out.append(sorted_utc[lo] * 60)
        else:  # gap: the first instant whose wall clock is past it (R1)
            out.append(utc_min[np.argmax(local_min > wall)] * 60)
    return np.unique(np.array(out, dtype=np.int64))  # R4


def fires(sched: crontab, start: float, end: float) -> np.ndarray:
    out = []
    for ts in sched.iter_from(start):
        if ts > end:
            break
        out.append(ts)
    return np.array(out, dtype=np.int64)


def window(ref: np.ndarray, start: float, end: float) -> np.ndarray:
    return ref[(ref > start) & (ref <= end)]


def transitions(zone: str) -> list[float]:
    utc_min, local_min = _scan(zone)
    jumps = np.nonzero(np.diff(local_min - utc_min))[0]
    return [float(utc_min[i + 1] * 60) for i in jumps]


YEAR_START, YEAR_END = _utc(YEAR, 1, 1), _utc(YEAR + 1, 1, 1)


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize(("minute", "hour"), [*FIXED, ("0", "*")])
def test_full_year_matches_brute_force(zone: str, minute: str, hour: str) -> None:
    sched = crontab(minute, hour, tz=zone)
    ref = window(reference(zone, minute, hour), YEAR_START, YEAR_END)
    np.testing.assert_array_equal(fires(sched, YEAR_START, YEAR_END), ref)


@pytest.mark.parametrize("zone", ["America/New_York", "Australia/Lord_Howe"])
def test_full_year_every_15_minutes(zone: str) -> None:
    sched = crontab("*/15", tz=zone)
    ref = window(reference(zone, "*/15", "*"), YEAR_START, YEAR_END)
    np.testing.assert_array_equal(fires(sched, YEAR_START, YEAR_END), ref)


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize(("minute", "hour"), [("*/15", "*"), *WILDCARD, ("30", "2"), ("*", "*")])
def test_transition_days_match_brute_force(zone: str, minute: str, hour: str) -> None:
    sched = crontab(minute, hour, tz=zone)
    ref = reference(zone, minute, hour)
    found = transitions(zone)
    assert len(found) == 2, found
    # every-minute entries only around the transition itself, to keep the suite fast
    span = 4 * 3600 if minute == "*" else 2 * 86400
    for instant in found:
        start, end = instant - span, instant + span
        np.testing.assert_array_equal(fires(sched, start, end), window(ref, start, end))


@pytest.mark.parametrize("zone", ["America/New_York", "Europe/London", "Pacific/Chatham"])
def test_day_of_week_entry(zone: str) -> None:
    sched = crontab("30", "1", "sun", tz=zone)
    ref = window(reference(zone, "30", "1", "sun"), YEAR_START, YEAR_END)
    np.testing.assert_array_equal(fires(sched, YEAR_START, YEAR_END), ref)


@settings(max_examples=200, deadline=None)
@given(
    zone=st.sampled_from(ZONES),
    entry=st.sampled_from([*FIXED, *WILDCARD]),
    after=st.floats(min_value=YEAR_START, max_value=YEAR_END - 3 * 86400),
)
def test_next_fire_from_any_instant(zone: str, entry: tuple[str, str], after: float) -> None:
    ref = reference(zone, *entry)
    expected = ref[ref > after][0]
    assert crontab(*entry, tz=zone).next_ts(after) == expected


@settings(max_examples=200, deadline=None)
@given(
    zone=st.sampled_from(ZONES),
    hour=st.integers(0, 23),
    minute=st.sampled_from([0, 15, 30, 45]),
    after=st.floats(min_value=YEAR_START, max_value=YEAR_END - 3 * 86400),
)
def test_next_local_follows_the_fixed_rules(zone: str, hour: int, minute: int, after: float) -> None:
    when = dt.datetime.fromtimestamp(after, UTC)
    after = when.timestamp()  # a datetime holds microseconds: compare from the instant next_local was given
    got = next_local(dt.time(hour, minute), zone, after=when)
    assert got.tzinfo is not None
    assert got.timestamp() == crontab(str(minute), str(hour), tz=zone).next_ts(after)


def _z(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def _all(sched: crontab, start: str, end: str) -> list[dt.datetime]:
    return [dt.datetime.fromtimestamp(t, UTC) for t in fires(sched, _z(start).timestamp(), _z(end).timestamp())]


def test_design_examples_2026() -> None:
    ny, london = "America/New_York", "Europe/London"
    # R1: 02:30 does not exist in New York on 8 March: fire at the transition, 07:00Z.
    assert _all(crontab("30", "2", tz=ny), "2026-03-08T00:00", "2026-03-09T00:00") == [_z("2026-03-08T07:00")]
    # R2: 01:30 happens twice on 1 November: fire once, at the first pass.
    assert _all(crontab("30", "1", tz=ny), "2026-11-01T00:00", "2026-11-02T00:00") == [_z("2026-11-01T05:30")]
    # R3: the hourly entry fires in both passes.
    hourly = _all(crontab("30", "*", tz=ny), "2026-11-01T04:00", "2026-11-01T07:00")
    assert hourly == [_z("2026-11-01T04:30"), _z("2026-11-01T05:30"), _z("2026-11-01T06:30")]
    assert _all(crontab("30", "1", tz=london), "2026-03-29T00:00", "2026-03-30T00:00") == [_z("2026-03-29T01:00")]
    assert _all(crontab("30", "1", tz=london), "2026-10-25T00:00", "2026-10-26T00:00") == [_z("2026-10-25T00:30")]
    # next_local on the same nights
    assert next_local(dt.time(2, 30), ny, after=_z("2026-03-08T00:00")) == _z("2026-03-08T07:00")
    assert next_local(dt.time(1, 30), ny, after=_z("2026-11-01T00:00")) == _z("2026-11-01T05:30")
    assert next_local(dt.time(1, 30), ny, after=_z("2026-11-01T05:30")) == _z("2026-11-02T06:30")
    assert next_local(dt.time(9, 0), "Europe/Berlin", after=_z("2026-03-29T06:00")) == _z("2026-03-29T07:00")


def test_skipped_minutes_of_a_wildcard_entry_do_not_happen() -> None:
    got = _all(crontab("*/15", "2", tz="America/New_York"), "2026-03-08T00:00", "2026-03-09T00:00")
    assert got == []


def test_lord_howe_half_hour_shift() -> None:
    # Lord Howe moves 30 minutes: 02:00 -> 02:30 on 5 April 2026 is a fall-back (02:00-02:30 twice).
    sched = crontab("15", "1-3", tz="Australia/Lord_Howe")
    got = _all(sched, "2026-04-04T13:00", "2026-04-04T18:00")
    ref = window(reference("Australia/Lord_Howe", "15", "1-3"), _utc(2026, 4, 4, 13), _utc(2026, 4, 4, 18))
    assert [t.timestamp() for t in got] == list(ref)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"minute": "61"}, "minute"),
        ({"hour": "25"}, "hour"),
        ({"day_of_week": "funday"}, "day_of_week"),
        ({"day_of_month": "0"}, "day_of_month"),
        ({"month_of_year": "13"}, "month_of_year"),
        ({"tz": "Mars/Olympus_Mons"}, "tz"),
        ({"tz": 5}, "tz"),
    ],
)
def test_invalid_fields_raise_at_definition(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ScheduleError, match=field):
        crontab(**kwargs)


def test_impossible_date_raises() -> None:
    with pytest.raises(ScheduleError):
        crontab("0", "0", day_of_month="31", month_of_year="2")


def test_next_local_rejects_bad_input() -> None:
    with pytest.raises(ScheduleError, match="tz"):
        next_local(dt.time(9), "Nowhere/City")
    with pytest.raises(ScheduleError, match="time"):
        next_local("09:00", "UTC")  # type: ignore[arg-type]


def test_pickle_and_equality_keep_tz() -> None:
    sched = crontab("30", "2", tz="Europe/Berlin")
    again = pickle.loads(pickle.dumps(sched))
    assert again == sched
    assert again.next_ts(YEAR_START) == sched.next_ts(YEAR_START)
    assert crontab("30", "2", tz="Europe/London") != sched
    assert "tz=Europe/Berlin" in repr(sched)


def test_is_due_uses_injected_now() -> None:
    now = [_z("2026-03-08T07:00:01")]
    sched = crontab("30", "2", tz="America/New_York", nowfun=lambda: now[0])
    due, remaining = sched.is_due(_z("2026-03-07T07:30"))
    assert due
    assert remaining == pytest.approx(23.5 * 3600 - 1)  # next: 02:30 EDT on 9 March = 06:30Z
    now[0] = _z("2026-03-08T06:59:00")
    due, remaining = sched.is_due(_z("2026-03-07T07:30"))
    assert not due
    assert remaining == pytest.approx(60)


def test_from_celery_crontab() -> None:
    from celery.schedules import crontab as plain

    ours = crontab.from_celery(plain("30", "2"), tz="America/New_York")
    assert ours.next_after(_z("2026-03-08T00:00")) == _z("2026-03-08T07:00")
