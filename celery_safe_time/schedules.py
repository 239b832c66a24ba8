"""DST-correct ``crontab`` and ``next_local``.

Fire instants are computed in UTC from the wall clock of a timezone with cron's rules:

- R1 gap: a fixed-time entry whose wall time does not exist fires once, at the transition.
- R2 overlap: a fixed-time entry whose wall time occurs twice fires once, at the first occurrence.
- R3 wildcards: an entry with ``*`` in the minute or hour field follows real time (both passes
  of a repeated hour fire; skipped minutes do not happen).
- R4: at most one fire per instant; fire instants strictly increase.

Everything here is pure: the caller passes ``after`` (and ``now`` through ``nowfun``). Wall times
are naive datetimes and instants are UNIX timestamps; aware datetimes only appear at the edges,
because arithmetic on aware datetimes in one zone silently ignores offset changes.
"""

from __future__ import annotations

import calendar
import datetime as dt
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import ParseException, schedstate
from celery.schedules import crontab as celery_crontab

from .clock import UTC, local_time
from .exceptions import ScheduleError

__all__ = ["crontab", "next_local", "resolve_tz", "wall_instants"]

#: Give up looking for the next fire after this many days (e.g. 29 February on a Monday).
MAX_SEARCH_DAYS = 366 * 29
_DAY = dt.timedelta(days=1)

TzArg = str | dt.tzinfo | None


def resolve_tz(tz: str | dt.tzinfo, *, what: str = "tz") -> dt.tzinfo:
    """An IANA name or tzinfo -> tzinfo; unknown names raise :class:`ScheduleError` naming ``what``."""
    if isinstance(tz, dt.tzinfo):
        return tz
    if not isinstance(tz, str) or not tz:
        raise ScheduleError(f"{what}: expected an IANA timezone name or tzinfo, got {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ScheduleError(f"{what}: unknown timezone {tz!r} ({exc.__class__.__name__})") from None


def _local(ts: float, tz: dt.tzinfo) -> dt.datetime:
    """Instant -> naive wall time in ``tz``."""
    return dt.datetime.fromtimestamp(ts, tz).replace(tzinfo=None)


def _naive_utc(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, UTC).replace(tzinfo=None)


def _offset(ts: float, tz: dt.tzinfo) -> float:
    off = dt.datetime.fromtimestamp(ts, tz).utcoffset()
    return off.total_seconds() if off is not None else 0.0


def _transition(before: float, after: float, tz: dt.tzinfo) -> float:
    """First whole second in ``(before, after]`` whose UTC offset differs from ``before``'s."""
    base = _offset(before, tz)
    lo, hi = int(before), int(after)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset(mid, tz) == base:
            lo = mid
        else:
            hi = mid
    return float(hi)


def wall_instants(wall: dt.datetime, tz: dt.tzinfo, *, fixed: bool) -> list[float]:
    """UTC instants (ascending) at which a schedule naming the naive ``wall`` time fires.

    ``fixed`` selects R1/R2 (one instant, gap -> transition, overlap -> first pass); otherwise
    R3 (every real occurrence: none in a gap, two in an overlap).
    """
    t0 = wall.replace(tzinfo=tz, fold=0).timestamp()
    t1 = wall.replace(tzinfo=tz, fold=1).timestamp()
    if t0 == t1:
        return [t0]
    first, second = min(t0, t1), max(t0, t1)
    if _local(first, tz) == wall and _local(second, tz) == wall:  # overlap: both passes exist
        return [first] if fixed else [first, second]
    if _local(t0, tz) == wall:  # odd zones: only one fold maps back
        return [t0]
    if _local(t1, tz) == wall:
        return [t1]
    return [_transition(first, second, tz)] if fixed else []


def _offset_bounds(ts: float, tz: dt.tzinfo) -> tuple[float, float]:
    """Smallest and largest UTC offset within two days of ``ts`` (equal unless a change is near)."""
    offsets = [_offset(ts + d, tz) for d in (-2 * 86400, 0, 2 * 86400)]
    return min(offsets), max(offsets)


def _is_wildcard(spec: Any) -> bool:
    # cron (cronie) treats a field as "wildcard" when it is written with '*' (incl. '*/15').
    return isinstance(spec, str) and "*" in spec


#: The longest each month gets (February in a leap year, 2000).
_DAYS_IN_MONTH = {month: calendar.monthrange(2000, month)[1] for month in range(1, 13)}


class crontab(celery_crontab):
    """A ``celery.schedules.crontab`` with DST-correct fire instants in ``tz``.

    ``tz`` is an IANA name or tzinfo; None means the app's timezone. Invalid fields or
    timezones raise :class:`~celery_safe_time.exceptions.ScheduleError` naming the field.
    Day of month and day of week must both match (Celery's rule, unlike cron's OR).
    """

    def __init__(
        self,
        minute: Any = "*",
        hour: Any = "*",
        day_of_week: Any = "*",
        day_of_month: Any = "*",
        month_of_year: Any = "*",
        tz: TzArg = None,
        **kwargs: Any,
    ) -> None:
        for field, value, max_, min_ in (
            ("minute", minute, 60, 0),
            ("hour", hour, 24, 0),
            ("day_of_week", day_of_week, 7, 0),
            ("day_of_month", day_of_month, 31, 1),
            ("month_of_year", month_of_year, 12, 1),
        ):
            try:
                values = celery_crontab._expand_cronspec(value, max_, min_)
            except (ValueError, ParseException, TypeError) as exc:
                raise ScheduleError(f"crontab {field}={value!r}: {exc}") from None
            if not values:
                raise ScheduleError(f"crontab {field}={value!r}: matches nothing")
        try:
            super().__init__(minute, hour, day_of_week, day_of_month, month_of_year, **kwargs)
        except (ValueError, ParseException) as exc:
            raise ScheduleError(
                f"crontab {minute} {hour} {day_of_month} {month_of_year} {day_of_week}: {exc}"
            ) from None
        # Celery 5.5+ raises this itself; Celery 5.4 accepts the 31st of February and never fires.
        if not any(day <= _DAYS_IN_MONTH[month] for month in self.month_of_year for day in self.day_of_month):
            raise ScheduleError(
                f"crontab day_of_month={day_of_month!r} month_of_year={month_of_year!r}: no such date in any year"
            )
        self._tz_arg = tz
        if tz is not None:
            # BaseSchedule.tz is a cached_property; seeding it keeps the app timezone out of it.
            self.__dict__["tz"] = resolve_tz(tz)
        self.fixed = not (_is_wildcard(minute) or _is_wildcard(hour))
        self._minutes = sorted(self.minute)
        self._hours = sorted(self.hour)

    # --- pure logic -----------------------------------------------------------------
    def _date_matches(self, day: dt.date) -> bool:
        return (
            day.month in self.month_of_year
            and day.day in self.day_of_month
            and (day.isoweekday() % 7) in self.day_of_week
        )

    def _walls(self, lower: dt.datetime) -> Iterator[dt.datetime]:
        """Matching wall times from ``lower`` on, ascending."""
        day = lower.date()
        for _ in range(MAX_SEARCH_DAYS):
            if self._date_matches(day):
                for hour in self._hours:
                    if day == lower.date() and hour < lower.hour:
                        continue
                    for minute in self._minutes:
                        wall = dt.datetime(day.year, day.month, day.day, hour, minute)
                        if wall >= lower:
                            yield wall
            day += _DAY
        raise ScheduleError(f"{self!r} never fires within {MAX_SEARCH_DAYS} days")

    def next_ts(self, after: float) -> float:
        """The first fire instant strictly after the UNIX timestamp ``after``."""
        tz = self.tz
        min_off, max_off = _offset_bounds(after, tz)
        # A wall time w fires within [w - max_off, w - min_off]: walls before ``lower`` cannot be
        # after ``after``, and once w - max_off passes the best instant nothing later can win.
        lower = _naive_utc(after + min_off)
        best: float | None = None
        for wall in self._walls(lower):
            if best is not None and (wall - _naive_utc(best)).total_seconds() > max_off:
                break
            for instant in wall_instants(wall, tz, fixed=self.fixed):
                if instant > after and (best is None or instant < best):
                    best = instant
            if best is not None and min_off == max_off:
                break
        assert best is not None
        return best

    def next_after(self, after: dt.datetime) -> dt.datetime:
        """The first fire instant strictly after ``after``, as an aware UTC datetime."""
        return dt.datetime.fromtimestamp(self.next_ts(_ts(after)), UTC)

    def iter_from(self, after: float) -> Iterator[float]:
        """Fire instants after ``after``, ascending (R4)."""
        ts = after
        while True:
            ts = self.next_ts(ts)
            yield ts

    # --- celery's schedule protocol -------------------------------------------------
    def _now_ts(self) -> float:
        return _ts(self.now())

    def remaining_estimate(self, last_run_at: dt.datetime, ffwd: Any = None) -> dt.timedelta:
        return dt.timedelta(seconds=self.next_ts(_ts(last_run_at)) - self._now_ts())

    def is_due(self, last_run_at: dt.datetime) -> schedstate:
        now = self._now_ts()
        if self.next_ts(_ts(last_run_at)) <= now:
            return schedstate(True, self.next_ts(now) - now)
        return schedstate(False, self.next_ts(_ts(last_run_at)) - now)

    def __reduce__(self) -> Any:
        return (
            self.__class__,
            (
                self._orig_minute,
                self._orig_hour,
                self._orig_day_of_week,
                self._orig_day_of_month,
                self._orig_month_of_year,
                self._tz_arg,
            ),
        )

    def __repr__(self) -> str:
        base: str = super().__repr__()
        return base[:-1] + f" tz={self._tz_arg}>" if self._tz_arg is not None else base

    def __eq__(self, other: Any) -> bool:
        result = super().__eq__(other)
        if result is True and isinstance(other, crontab):
            return str(self.tz) == str(other.tz)
        return result  # type: ignore[no-any-return]

    def __hash__(self) -> int:
        return hash((self._orig_minute, self._orig_hour, self._orig_day_of_week, str(self._tz_arg)))

    @classmethod
    def from_celery(cls, schedule: celery_crontab, tz: TzArg = None) -> crontab:
        """Our crontab with the fields of a plain ``celery.schedules.crontab`` (tz defaults to its tz)."""
        if isinstance(schedule, cls) and tz is None:
            return schedule
        made = cls(
            schedule._orig_minute,
            schedule._orig_hour,
            schedule._orig_day_of_week,
            schedule._orig_day_of_month,
            schedule._orig_month_of_year,
            tz=tz if tz is not None else schedule.__dict__.get("tz"),
            nowfun=schedule.nowfun,
            app=schedule._app,
        )
        return made


def _ts(value: dt.datetime | float) -> float:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)  # Celery's convention: naive means UTC
        return value.timestamp()
    return float(value)


def next_local(time: dt.time, tz: str | dt.tzinfo, after: dt.datetime | None = None) -> dt.datetime:
    """The next instant strictly after ``after`` (default: now) at which the wall clock in ``tz``
    shows ``time``, as an aware UTC datetime (R1: a missing time -> the transition; R2: a
    repeated time -> its first occurrence). Pass it as ``eta``."""
    if not isinstance(time, dt.time):
        raise ScheduleError(f"next_local: time must be a datetime.time, got {time!r}")
    zone = resolve_tz(tz)
    after_ts = local_time() if after is None else _ts(after)
    start = _local(after_ts, zone).date() - _DAY
    for offset in range(5):
        day = start + offset * _DAY
        wall = dt.datetime.combine(day, time.replace(tzinfo=None))
        for instant in wall_instants(wall, zone, fixed=True):
            if instant > after_ts:
                return dt.datetime.fromtimestamp(instant, UTC)
    raise ScheduleError(f"next_local: no {time} in {tz} after {after}")  # pragma: no cover
