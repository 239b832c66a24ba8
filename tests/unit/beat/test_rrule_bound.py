"""The next-occurrence search of an rrule schedule is bounded (``RRULE_SEARCH_YEARS``) and exact: a rule
that never fires again answers NEVER after a search of at most two Gregorian cycles, not a walk to the
year 9999; a rule that fires gives dateutil's own answer, however far away."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from dateutil.rrule import rrule as dateutil_rrule
from dateutil.rrule import rrulestr

from celery_safe_time import constants as C
from celery_safe_time.beat.slots import NEVER, bounded_after, rrule

UTC = ZoneInfo("UTC")
PARIS = ZoneInfo("Europe/Paris")
NOW = datetime(2026, 12, 4, 23, 0, tzinfo=UTC).timestamp()

NEVER_FIRING = [
    "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30",  # 30 February
    "FREQ=MONTHLY;BYMONTH=2;BYMONTHDAY=31",
    "FREQ=MONTHLY;BYDAY=MO;BYSETPOS=6",  # no month has six Mondays
    "FREQ=HOURLY;BYMONTH=4;BYMONTHDAY=31",
]


def _rule(text: str, start: datetime) -> dateutil_rrule:
    made = rrulestr("RRULE:" + text, dtstart=start)
    assert isinstance(made, dateutil_rrule)
    return made


@pytest.mark.parametrize("text", NEVER_FIRING)
@pytest.mark.parametrize("zone", [None, PARIS])
def test_a_rule_that_never_fires_is_never_after_a_bounded_search(text: str, zone: ZoneInfo | None) -> None:
    """NEVER, found by dateutil's search of the rule moved forward by whole Gregorian cycles, so that
    the year 9999 where dateutil stops is ``RRULE_SEARCH_YEARS`` to one cycle more past the moment
    (dateutil's own walk from 2026 took 2.9 s of CPU for the daily rule, 5.4 s for the hourly one;
    the bounded one 0.3-0.5 s: a benchmark's measure, not this test's: a loaded CI counted 1.6 s)."""
    # A start of this test's own, so no answer of another test (the per-process memo) is reused.
    start = datetime(2026, 1, 1, 9, 0, NEVER_FIRING.index(text) + (30 if zone else 0), tzinfo=zone)
    assert rrule(_rule(text, start)).next_ts(NOW) == NEVER
    moment = datetime.fromtimestamp(NOW, zone or UTC).replace(tzinfo=zone)
    probes: dict[int, dateutil_rrule] = {}
    assert bounded_after(_rule(text, start), moment, probes) is None
    [years] = probes
    searched = datetime.max.year - (moment.year + years)  # the years dateutil walked past the moment
    assert C.RRULE_SEARCH_YEARS <= searched < C.RRULE_SEARCH_YEARS + C.GREGORIAN_CYCLE_YEARS


@pytest.mark.parametrize(
    ("text", "start", "expected"),
    [
        ("FREQ=DAILY", datetime(3500, 6, 1, 9), datetime(3500, 6, 1, 9)),
        ("FREQ=DAILY", datetime(9990, 6, 1, 9), datetime(9990, 6, 1, 9)),
        # A leap day that is a Monday: 2044 after 2026 (a search of 18 years).
        ("FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=29;BYDAY=MO", datetime(2026, 1, 1, 9), datetime(2044, 2, 29, 9)),
        # First fires 500 years from now: past the 400-year horizon of a rule already started.
        ("FREQ=YEARLY;INTERVAL=500", datetime(2000, 3, 1, 9), datetime(2500, 3, 1, 9)),
    ],
)
def test_a_rule_that_first_fires_far_ahead_is_found(text: str, start: datetime, expected: datetime) -> None:
    rule = _rule(text, start)
    assert rrule(rule).next_ts(NOW) == expected.replace(tzinfo=UTC).timestamp()


RULES = [
    "FREQ=DAILY;BYHOUR=9;BYMINUTE=30",
    "FREQ=WEEKLY;INTERVAL=3;BYDAY=TU,FR",
    "FREQ=MONTHLY;BYMONTHDAY=-1",
    "FREQ=MONTHLY;BYDAY=FR;BYMONTHDAY=13",
    "FREQ=MONTHLY;INTERVAL=7;BYDAY=MO;BYSETPOS=-1",
    "FREQ=YEARLY;BYWEEKNO=53;BYDAY=TH",
    "FREQ=YEARLY;BYYEARDAY=366",
    "FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=29",
    "FREQ=HOURLY;INTERVAL=5;BYMINUTE=7",
    "FREQ=MINUTELY;INTERVAL=97;BYHOUR=2",
    "FREQ=DAILY;COUNT=40",
    "FREQ=DAILY;COUNT=4000",
    "FREQ=WEEKLY;UNTIL=20270315T000000",
    "FREQ=DAILY;UNTIL=20200101T000000",
    "FREQ=MONTHLY;UNTIL=29000101T000000",  # an end past the moved search's last year
    "FREQ=YEARLY;BYEASTER=0",
]
MOMENTS = [
    datetime(2026, 3, 29, 0, 30),  # the night clocks go forward in Paris
    datetime(2026, 10, 25, 1, 30),  # and back
    datetime(2027, 12, 31, 23, 59),
    datetime(2096, 2, 28, 12),
    datetime(2099, 3, 1),
]


@pytest.mark.parametrize("text", RULES)
@pytest.mark.parametrize("zone", [None, PARIS])
def test_the_bounded_search_answers_as_dateutil(text: str, zone: ZoneInfo | None) -> None:
    if "UNTIL" in text and zone is not None:
        text += "Z"  # an aware start needs an aware end
    rule = _rule(text, datetime(2026, 1, 1, 9, 15, tzinfo=zone))
    probes: dict[int, dateutil_rrule] = {}
    for moment in MOMENTS:
        moment = moment.replace(tzinfo=zone)
        assert bounded_after(rule, moment, probes) == rule.after(moment, inc=False), (text, moment)


def test_the_horizon_is_one_gregorian_cycle_at_least() -> None:
    # 400 years: the calendar repeats after it, so "none in the horizon" means "none ever".
    assert C.RRULE_SEARCH_YEARS >= C.GREGORIAN_CYCLE_YEARS == 400
