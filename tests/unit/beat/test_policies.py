"""Schedule policies per entry, pure: jitter offsets, the catch-up window, resumed entries, validation."""

from __future__ import annotations

import collections
import datetime as dt
import json
from types import SimpleNamespace

import pytest
from celery import Celery

from celery_safe_time import crontab
from celery_safe_time.beat.policies import (
    OPTION_CATCHUP_WINDOW,
    OPTION_JITTER,
    config_spec,
    jitter_offset,
    policies_of,
    policy_options,
)
from celery_safe_time.beat.slots import CronGrid, IntervalGrid, Plan, decide, entry_plan, next_state
from celery_safe_time.beat.state import dump_state
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError

UTC = dt.timezone.utc
MINUTE = dt.datetime(2026, 12, 3, 9, 0, tzinfo=UTC).timestamp()  # "0 9 * * *" today


def test_an_offset_is_within_the_window_in_whole_milliseconds_and_the_same_in_every_process() -> None:
    offsets = [jitter_offset(f"tenant-{i}", MINUTE, 30.0) for i in range(200)]
    assert all(0 <= o < 30 for o in offsets)
    assert all(abs(o * 1000 - round(o * 1000)) < 1e-6 for o in offsets)
    assert jitter_offset("tenant-1", MINUTE, 30.0) == offsets[1]  # deterministic
    assert jitter_offset("x", MINUTE, 0.0) == 0.0
    # the same entry lands elsewhere on other slots
    assert len({jitter_offset("tenant-1", MINUTE + 60 * k, 30.0) for k in range(20)}) > 10


def test_an_offset_does_not_depend_on_the_process_hash_seed() -> None:
    import subprocess
    import sys

    code = "from celery_safe_time.beat.policies import jitter_offset; print(jitter_offset('a', 1800000000.0, 30.0))"
    values = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed}, check=True
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert values == {str(jitter_offset("a", 1800000000.0, 30.0))}


@pytest.mark.parametrize("entries", [1_000, 10_000])
def test_jitter_spreads_entries_of_one_minute_evenly(entries: int) -> None:
    per_second = collections.Counter(int(jitter_offset(f"tenant-{i}", MINUTE, 30.0)) for i in range(entries))
    mean = entries / 30
    assert set(per_second) == set(range(30))
    assert max(per_second.values()) <= 2 * mean
    assert min(per_second.values()) >= mean / 2


def test_a_jittered_slot_is_due_at_its_offset_and_late_from_there() -> None:
    grid = CronGrid(crontab("0", "9", tz="UTC"))
    offset = jitter_offset("e", MINUTE, 30.0)
    assert offset > 1  # the assertions below need an offset of a few seconds
    fn = lambda slot: jitter_offset("e", slot, 30.0)  # noqa: E731
    before = decide(grid, MINUTE, MINUTE + offset - 0.5, policy="run_once", on_time=6, grace=None, offset=fn)
    assert before.fire == []
    assert before.next == MINUTE  # not due yet: still the same slot
    assert before.missed == 0
    at = decide(grid, MINUTE, MINUTE + offset + 5, policy="skip", on_time=6, grace=None, offset=fn)
    assert at.fire == [MINUTE]  # 5 s after its jittered instant: on time, even under skip
    assert at.next == MINUTE + 86400


def test_the_catch_up_window_skips_late_slots_whatever_the_policy() -> None:
    grid = IntervalGrid(10.0)
    for policy in ("run_once", "run_all", "skip"):
        d = decide(grid, 100.0, 200.5, policy=policy, on_time=1, grace=None, window=25)
        # slots 100..170 are more than 25 s late: skipped; 180 and 190 missed; 200 on time
        assert d.expired == 8
        assert d.fire == {"run_once": [200.0], "run_all": [180.0, 190.0, 200.0], "skip": [200.0]}[policy]
        assert d.next == 210.0
    # run_once whose only missed slots are past the window: nothing
    d = decide(grid, 100.0, 125.0, policy="run_once", on_time=1, grace=None, window=4)
    assert d.fire == []
    assert (d.expired, d.missed, d.next) == (3, 3, 130.0)


def test_the_catch_up_window_and_on_time_slots() -> None:
    grid = IntervalGrid(10.0)
    d = decide(grid, 100.0, 130.0, policy="run_once", on_time=1, grace=None, window=5)
    assert d.fire == [130.0]
    assert d.expired == 3
    assert d.missed == 3
    # a window shorter than the on-time allowance wins: a slot 20 s late is skipped
    d = decide(grid, 100.0, 120.0, policy="run_all", on_time=30, grace=None, window=10)
    assert d.fire == [110.0, 120.0]
    assert d.expired == 1


def test_a_resumed_entry_continues_at_its_next_slot_only() -> None:
    plan = Plan(grid=IntervalGrid(60.0), policy="run_once")
    paused_state = json.loads(dump_state(1000.0, 1060.0, plan.signature))
    # resumed 10 minutes later: no catch-up run; the grid goes on at 1660 (not at once, not 1060)
    planned = next_state(plan, paused_state, None, 1630.0, resumed=True)
    assert planned is not None
    state, due = planned
    assert due == 1660.0
    assert json.loads(state)["next"] == 1660.0
    # not a resume (the due set was lost): the next slot stays, its misfire policy decides later
    planned = next_state(plan, paused_state, None, 1630.0)
    assert planned is not None
    assert planned[1] == 1060.0


def test_next_state_moves_the_due_score_when_the_jitter_changes_and_keeps_the_slot() -> None:
    plan = Plan(grid=IntervalGrid(60.0), policy="run_once", jitter=30.0)
    state = json.loads(dump_state(1000.0, 1060.0, plan.signature))
    planned = next_state(plan, state, 1060.0, 1010.0, name="e")  # jitter added to an entry
    assert planned is not None
    assert json.loads(planned[0])["next"] == 1060.0
    assert planned[1] == 1060.0 + jitter_offset("e", 1060.0, 30.0)
    assert next_state(plan, state, planned[1], 1010.0, name="e") is None  # then it stands


def test_a_lost_state_finds_the_slot_of_a_jittered_due_score() -> None:
    cron = Plan(grid=CronGrid(crontab("*/5", tz="UTC")), policy="run_once", jitter=120.0)
    slot = MINUTE + 300
    assert cron.slot_at("e", cron.due_at("e", slot)) == slot
    every = Plan(grid=IntervalGrid(60.0), policy="run_once", jitter=20.0)
    assert every.slot_at("e", every.due_at("e", 1_800_000_007.0)) == 1_800_000_007.0
    planned = next_state(every, {}, every.due_at("e", 1_800_000_007.0), 1_800_000_000.0, name="e")
    assert planned is not None
    assert json.loads(planned[0])["next"] == 1_800_000_007.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({OPTION_JITTER: "30"}, "entry 'e': safe_time_jitter must be a number of seconds or a timedelta"),
        ({OPTION_JITTER: True}, "entry 'e': safe_time_jitter must be a number of seconds or a timedelta"),
        ({OPTION_JITTER: -1}, "entry 'e': safe_time_jitter must be at least 0 seconds"),
        ({OPTION_JITTER: float("nan")}, "entry 'e': safe_time_jitter must be at least 0 seconds"),
        ({OPTION_CATCHUP_WINDOW: 0}, "entry 'e': safe_time_catchup_window must be above 0 seconds"),
        ({OPTION_CATCHUP_WINDOW: [1]}, "entry 'e': safe_time_catchup_window must be a number"),
    ],
)
def test_bad_policies_name_the_entry_and_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(")):
        policies_of(options, "e")
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(")):
        policy_options("e", options)


def test_policy_keywords_become_options_in_seconds() -> None:
    assert policy_options("e", {"queue": "q"}, jitter=dt.timedelta(seconds=30), catchup_window=3600) == {
        "queue": "q",
        OPTION_JITTER: 30.0,
        OPTION_CATCHUP_WINDOW: 3600.0,
    }
    with pytest.raises(ScheduleError, match="entry 'e': jitter is given twice"):
        policy_options("e", {OPTION_JITTER: 1}, jitter=2)
    spec = config_spec("e", {"task": "t", "schedule": 60, "jitter": dt.timedelta(seconds=5), "options": {"q": 1}})
    assert spec == {"task": "t", "schedule": 60, "options": {"q": 1, OPTION_JITTER: 5.0}}


def _noop() -> None:
    return None


def test_entry_plan_refuses_a_jitter_as_long_as_the_interval() -> None:
    app = Celery("policies", set_as_current=False)
    app.conf.update(broker_url="memory://", safe_time_redis_url="redis://127.0.0.1:1/0", timezone="UTC")
    app.task(name="t.p", shared=False)(_noop)
    config = get_config(app)

    def entry(**options: object) -> SimpleNamespace:
        return SimpleNamespace(name="e", task="t.p", schedule=10.0, options=options)

    plan = entry_plan(entry(safe_time_jitter=9.5, safe_time_catchup_window=60), config, app)
    assert (plan.jitter, plan.catchup_window) == (9.5, 60.0)
    with pytest.raises(ScheduleError, match=r"entry 'e': safe_time_jitter \(10 s\) must be shorter than its interval"):
        entry_plan(entry(safe_time_jitter=10), config, app)
    with pytest.raises(ScheduleError, match="entry 'e': safe_time_catchup_window must be above 0"):
        entry_plan(entry(safe_time_catchup_window=-5), config, app)
