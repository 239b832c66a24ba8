"""Runtime entry definitions: schedule JSON round trips, canonical definitions, one-off and rrule grids."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_interval
from celery.schedules import solar
from dateutil.rrule import DAILY, HOURLY
from dateutil.rrule import rrule as dateutil_rrule

from celery_safe_time import constants as C
from celery_safe_time import crontab
from celery_safe_time.beat.entries import definition_json, parse_definition, schedule_from_spec, schedule_to_spec
from celery_safe_time.beat.slots import NEVER, OneOffGrid, RRuleGrid, at, decide, grid_for, rrule
from celery_safe_time.exceptions import ScheduleError, SerializationError

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


def _ts(*args: int, tz: timezone | ZoneInfo = UTC) -> float:
    return datetime(*args, tzinfo=tz).timestamp()  # type: ignore[misc]


def _round_trip(schedule: object) -> object:
    spec = schedule_to_spec(schedule)
    assert json.loads(json.dumps(spec)) == spec  # plain JSON another language can write
    return schedule_from_spec(spec)


def test_interval_forms_give_one_spec() -> None:
    for form in (60, 60.0, timedelta(minutes=1), celery_interval(timedelta(seconds=60))):
        assert schedule_to_spec(form) == {"type": "interval", "every": 60.0}
    back = _round_trip(30)
    assert isinstance(back, celery_interval)
    assert back.run_every == timedelta(seconds=30)


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), True, "every minute", object()])
def test_bad_schedules_are_refused(bad: object) -> None:
    with pytest.raises(ScheduleError):
        schedule_to_spec(bad)


def test_crontab_with_tz_keeps_the_dst_rules() -> None:
    back = _round_trip(crontab(minute=30, hour=2, tz="America/New_York"))
    assert isinstance(back, crontab)
    assert schedule_to_spec(back)["tz"] == "America/New_York"
    # R1: 02:30 does not exist on 8 March 2026 in New York: fires once at the transition, 07:00Z
    assert back.next_ts(_ts(2026, 3, 8, 0, 0)) == _ts(2026, 3, 8, 7, 0)


def test_plain_celery_crontab_means_the_app_timezone() -> None:
    spec = schedule_to_spec(celery_crontab(minute="*/15", hour="9-17", day_of_week="1-5"))
    assert spec == {
        "type": "crontab",
        "minute": "*/15",
        "hour": "9-17",
        "day_of_week": "1-5",
        "day_of_month": "*",
        "month_of_year": "*",
        "tz": None,
    }


def test_bad_crontab_spec_names_the_field() -> None:
    with pytest.raises(ScheduleError, match="hour"):
        schedule_from_spec({"type": "crontab", "minute": "0", "hour": "25"})
    with pytest.raises(ScheduleError, match="timezone"):
        schedule_from_spec({"type": "crontab", "minute": "0", "hour": "9", "tz": "Mars/Olympus"})
    with pytest.raises(ScheduleError, match="unknown schedule type"):
        schedule_from_spec({"type": "weekly"})


def test_solar_round_trip() -> None:
    back = _round_trip(solar("sunrise", 52.52, 13.405))
    assert isinstance(back, solar)
    assert (back.event, back.lat, back.lon) == ("sunrise", 52.52, 13.405)


def test_rrule_round_trip_in_a_zone_across_dst() -> None:
    rule = dateutil_rrule(DAILY, dtstart=datetime(2026, 3, 27, 9, 0, tzinfo=BERLIN), byhour=9, byminute=0)
    back = _round_trip(rule)
    assert isinstance(back, rrule)
    assert schedule_to_spec(back) == {
        "type": "rrule",
        "rule": "FREQ=DAILY;BYHOUR=9;BYMINUTE=0",
        "dtstart": "2026-03-27T09:00:00",
        "tz": "Europe/Berlin",
    }
    grid = grid_for(back, UTC)
    assert isinstance(grid, RRuleGrid)
    first = grid.first(_ts(2026, 3, 28, 12, 0))
    # 09:00 Berlin is 08:00Z before 29 March 2026 and 07:00Z after
    assert first == _ts(2026, 3, 29, 7, 0)
    assert grid.next(_ts(2026, 3, 27, 8, 0)) == _ts(2026, 3, 28, 8, 0)


def test_rrule_with_an_end_has_no_more_slots() -> None:
    rule = dateutil_rrule(HOURLY, dtstart=datetime(2026, 1, 1, 0, 0), count=2)  # naive: UTC
    grid = grid_for(rrule(rule), UTC)
    assert grid.first(_ts(2025, 12, 31, 0, 0)) == _ts(2026, 1, 1, 0, 0)
    assert grid.next(_ts(2026, 1, 1, 0, 0)) == _ts(2026, 1, 1, 1, 0)
    assert grid.next(_ts(2026, 1, 1, 1, 0)) == NEVER


def test_one_off_fires_once_then_never() -> None:
    when = datetime(2026, 12, 1, 9, 0, tzinfo=BERLIN)
    back = _round_trip(when)
    assert isinstance(back, at)
    assert schedule_to_spec(back) == {"type": "at", "at": "2026-12-01T09:00:00+01:00"}
    grid = grid_for(back, UTC)
    assert grid == OneOffGrid(when.timestamp())
    assert grid.first(0.0) == when.timestamp()
    d = decide(grid, when.timestamp(), when.timestamp() + 1, policy="run_once", on_time=30, grace=None)
    assert d.fire == [when.timestamp()]
    assert d.next == NEVER
    # a one-off found late follows the misfire policy like any slot
    late = decide(grid, when.timestamp(), when.timestamp() + 3600, policy="skip", on_time=30, grace=None)
    assert late.fire == []
    assert late.next == NEVER


def test_naive_one_off_is_utc() -> None:
    assert schedule_to_spec(datetime(2026, 1, 1, 9, 0)) == {"type": "at", "at": "2026-01-01T09:00:00+00:00"}


def test_definition_is_canonical_and_parses_back() -> None:
    spec = schedule_to_spec(crontab(minute=0, hour=9, tz="Europe/Berlin"))
    one = definition_json("t-42", "reports.send", spec, (42,), {"b": 1, "a": 2}, {"queue": "reports"}, True)
    two = definition_json("t-42", "reports.send", spec, [42], {"a": 2, "b": 1}, {"queue": "reports"}, True)
    assert one == two
    parsed = parse_definition(one)
    assert parsed["args"] == [42]
    assert parsed["enabled"] is True
    assert json.loads(one)["format"] == 1


def test_unserialisable_arguments_name_the_entry() -> None:
    spec = schedule_to_spec(10)
    with pytest.raises(SerializationError, match=r"'t-1'.*args"):
        definition_json("t-1", "x", spec, (object(),), {}, {}, True)
    with pytest.raises(SerializationError, match="kwargs"):
        definition_json("t-1", "x", spec, (), {"when": datetime.now()}, {}, True)


def test_another_language_may_omit_optional_fields() -> None:
    parsed = parse_definition('{"task": "reports.send", "schedule": {"type": "interval", "every": 5}}')
    assert parsed == {
        "name": None,
        "task": "reports.send",
        "schedule": {"type": "interval", "every": 5},
        "args": [],
        "kwargs": {},
        "options": {},
        "enabled": True,
        "paused": None,
    }
    with pytest.raises(ScheduleError, match="format"):
        parse_definition('{"format": 2, "task": "x"}')


def test_state_of_a_schedule_with_no_slot_left_is_valid_json() -> None:
    from celery_safe_time.beat.state import dump_state, load_state, state_next

    raw = dump_state(1764579600.0, NEVER, "at 1764579600.0")
    assert "Infinity" not in raw
    assert json.loads(raw)["next"] is None
    assert state_next(load_state(raw)) == NEVER
    assert state_next(load_state(dump_state(None, 5.0, "every 5s"))) == 5.0
    # a state holding ``Infinity`` reads as no slot left
    assert state_next(load_state('{"last": 1.0, "next": Infinity, "sig": "x"}')) == NEVER


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "options", "enabled"),
    [
        ("t-42", (42,), {}, {}, True),
        ("ténant-ü ☃", [1.5, "x", None, True, -0.0], {"b": 1, "a": {"z": [1, (2, 3)]}}, {"queue": "q"}, False),
        ("nested", [{"k": "v", "a": 1}], {"when": "2026-01-01"}, {"safe_time_jitter": 30.0, "priority": 3}, True),
        ('quote"and\\slash', [1e300, 2**70], {"1": "one"}, {}, True),
    ],
)
def test_definitions_are_the_canonical_json_of_their_fields(
    name: str, args: list[object], kwargs: dict[str, object], options: dict[str, object], enabled: bool
) -> None:
    # The stored bytes are what docs/beat.md's "Storage (for other languages)" promises: json.dumps
    # with sorted keys and no spaces. definition_text builds them by hand from pre-encoded parts.
    from celery_safe_time.beat.definitions import canonical_json, definition_text

    spec = {"type": "crontab", "minute": "0", "hour": "9", "day_of_week": "*", "day_of_month": "*",
            "month_of_year": "*", "tz": "Europe/Berlin"}  # fmt: skip
    paused = None if enabled else {"note": "holiday", "until": None}
    body = {"format": C.BEAT_ENTRY_FORMAT, "name": name, "task": "reports.send", "schedule": spec,
            "args": json.loads(json.dumps(list(args))), "kwargs": json.loads(json.dumps(kwargs)),
            "options": options, "enabled": enabled}  # fmt: skip
    if paused:
        body["paused"] = paused
    expected = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert definition_json(name, "reports.send", spec, args, kwargs, options, enabled, paused) == expected
    text = definition_text(
        name, canonical_json("reports.send"), canonical_json(spec), args, kwargs, options, enabled, paused
    )
    assert text == expected


def test_definition_text_refuses_what_definition_json_refuses() -> None:
    from celery_safe_time.beat.definitions import canonical_json, definition_text

    for args, kwargs in (((object(),), {}), ((), {"when": datetime.now()}), ((float("nan"),), {})):
        with pytest.raises(SerializationError):
            definition_text("t-1", '"x"', canonical_json({"type": "interval", "every": 1.0}), args, kwargs, {}, True)


def test_the_state_of_an_entry_that_never_fired_begins_as_the_saves_look_for_it() -> None:
    # The save scripts (lua/save_entry*.lua, sql/queries.sql seed_states) replace a stored state that
    # begins so, and keep one that fired: dump_state must keep writing ``last`` first.
    from importlib import resources

    from celery_safe_time.beat.backends.base import UNFIRED_STATE_PREFIX
    from celery_safe_time.beat.state import dump_state

    assert dump_state(None, 5.0, "every 5s").startswith(UNFIRED_STATE_PREFIX)
    assert not dump_state(1.0, 6.0, "every 5s").startswith(UNFIRED_STATE_PREFIX)
    beat = resources.files("celery_safe_time.beat")
    for script in ("lua/save_entry.lua", "lua/save_entries.lua"):
        text = beat.joinpath(script).read_text()
        assert f", 1, {len(UNFIRED_STATE_PREFIX)}) == '{UNFIRED_STATE_PREFIX}'" in text, script
    assert f"left(s.state, {len(UNFIRED_STATE_PREFIX)}) = :unfired" in beat.joinpath("sql/queries.sql").read_text()


def test_a_stored_time_that_cannot_be_read_shows_as_unknown_not_as_an_error() -> None:
    # One broken state must not fail `beat list` or `get_entry` for every entry: its times read as None.
    from celery_safe_time.beat.entries import _config_info
    from celery_safe_time.beat.state import instant

    assert instant(1_700_000_000) == datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)
    assert instant("1700000000.5") == datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=timezone.utc)
    for unreadable in (None, "garbage", [], float("inf"), NEVER, float("nan"), 1e300):
        assert instant(unreadable) is None
    spec = {"task": "reports.send", "schedule": 60.0}
    info = _config_info("broken", spec, '{"last": "garbage", "next": 1700000000}', 1_700_000_000)
    assert info.last_fired is None
    assert info.next_fire == datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)
    jittered = {**spec, "options": {"safe_time_jitter": 30}}
    info = _config_info("jittered", jittered, '{"last": null, "next": "garbage"}', 1_700_000_000)
    assert info.next_fire is None
    info = _config_info("jittered", jittered, '{"last": null, "next": 1699999990}', 1_700_000_000)
    assert info.next_fire == datetime(2023, 11, 14, 22, 13, 10, tzinfo=timezone.utc)
    assert _config_info("broken", spec, "{}", "garbage").next_fire is None
