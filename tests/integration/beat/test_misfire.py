"""Misfire policies after every beat was down across three slots; clock authority; bad input."""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from typing import Any

import pytest
import redis

from tests.helpers.beat import BEAT_APP, beat_env, duplicates, holder_pid, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

EVERY = 8


def _slots(client: redis.Redis, label: str) -> list[float]:
    return sorted(datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in runs(client, label))


def test_misfire_policies_per_entry_and_default(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    schedule = {
        name: {"task": "tests.record", "every": EVERY, "args": [name], **({"options": opts} if opts else {})}
        for name, opts in {
            "once": {"safe_time_misfire": "run_once"},
            "skip": {"safe_time_misfire": "skip"},
            "all": {"safe_time_misfire": "run_all"},
            "default": None,
        }.items()
    }
    env = beat_env(schedule, safe_time_beat_lease=3, safe_time_misfire="run_all", **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    first = processes.beat(BEAT_APP, env=env, name="first")
    wait_for(lambda: all(runs(redis_client, n) for n in schedule), 30, message="the first slot of every entry")
    first.terminate()
    s0 = _slots(redis_client, "once")[0]
    assert all(_slots(redis_client, n) == [s0] for n in schedule)
    # all beats down across S1, S2, S3; come back 4 s after S3 (missed: older than the 3 s lease)
    time.sleep(max(0.0, s0 + 3 * EVERY + 4 - time.time()))
    second = processes.beat(BEAT_APP, env=env, name="second")
    # S1..S3 are missed; S4 too when the second beat's start takes longer than the 4 s left before it
    # (a loaded machine): the beat says how many, and the first slot after them must be on time.
    found = second.wait_for_log(r"entry 'skip' missed (\d+) slot\(s\)", timeout=60)
    n_missed = int(found.group(1))
    assert n_missed in (3, 4), second.log()
    on_time = s0 + (n_missed + 1) * EVERY
    wait_for(lambda: all(on_time in _slots(redis_client, n) for n in schedule), 40, message="the first on-time slot")
    second.terminate()
    time.sleep(2)
    missed = {n: [s - s0 for s in _slots(redis_client, n) if s0 < s < on_time] for n in schedule}
    every_missed = [float(k * EVERY) for k in range(1, n_missed + 1)]
    # run_once publishes the latest missed slot only when no slot is on time in the same tick: a beat
    # whose first tick came just after S4 (within the lease: on time) publishes S4 and no catch-up.
    once_up_to = second.wait_for_log(r"entry 'once' missed \d+ slot\(s\) up to (\S+) ", timeout=5).group(1)
    with_on_time = datetime.fromisoformat(once_up_to).timestamp() >= on_time
    once = [] if with_on_time else every_missed[-1:]
    assert missed == {"once": once, "skip": [], "all": every_missed, "default": every_missed}, second.log()
    assert duplicates(redis_client) == {}
    assert f"missed {n_missed} slot(s)" in second.log()


def test_misfire_grace_skips_old_slots(processes: ProcessManager, redis_client: redis.Redis) -> None:
    """A grace of 9 s on a 4 s grid: the beat that comes back fires the missed slots at most 9 s old
    when it first looks (the last missed one, the one before, and the one before that only if it
    looked within a second of the last), never an older one, then goes on on the grid. What counts
    is when the second beat looked (its log names the last missed slot), not when the test started
    it: a process start took 19 s on a loaded machine."""
    schedule = {"all": {"task": "tests.record", "every": 4, "args": ["all"]}}
    env = beat_env(schedule, safe_time_beat_lease=3, safe_time_misfire="run_all", safe_time_misfire_grace=9)
    processes.worker(BEAT_APP, env=env, name="worker")
    first = processes.beat(BEAT_APP, env=env, name="first")
    wait_for(lambda: runs(redis_client, "all"), 30)
    first.terminate()
    s0 = _slots(redis_client, "all")[0]
    time.sleep(max(0.0, s0 + 4 * 4 + 1 - time.time()))  # S1..S4 missed, come back 1 s after S4 or later
    second = processes.beat(BEAT_APP, env=env, name="second")
    up_to_text = second.wait_for_log(r"entry 'all' missed \d+ slot\(s\) up to (\S+) ", timeout=90).group(1)
    up_to = datetime.fromisoformat(up_to_text).timestamp()  # it looked in [up_to, up_to + 4)
    wait_for(lambda: up_to + 4 in _slots(redis_client, "all"), 40, message="the slot after the last missed one")
    second.terminate()
    fired = set(_slots(redis_client, "all"))
    assert up_to >= s0 + 16  # at least S1..S4 were missed
    caught_up = sorted(s for s in fired if s0 < s <= up_to)
    assert up_to in caught_up, second.log()
    assert caught_up[0] >= up_to - 8, (caught_up, up_to)  # none older than the grace when it looked
    older = [s0 + 4 * k for k in range(1, 64) if s0 + 4 * k < up_to - 8]
    assert older
    assert not fired & set(older), second.log()
    assert duplicates(redis_client) == {}


def test_skewed_local_clocks_fire_on_the_backend_clock(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    """Redis TIME, or PostgreSQL's clock_timestamp(): the beats' own clocks never decide."""
    schedule = {"fast": {"task": "tests.record", "every": 2, "args": ["fast"]}}
    env = beat_env(schedule, safe_time_beat_lease=6, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    ahead = processes.beat(BEAT_APP, env={**env, "SAFE_TIME_LOCAL_CLOCK_SKEW": "30"}, name="ahead")
    wait_for(lambda: holder_pid(redis_client, coordination) == ahead.pid, 30, message="the skewed beat leads")
    wait_for(lambda: len(runs(redis_client)) >= 3, 30)
    behind = processes.beat(BEAT_APP, env={**env, "SAFE_TIME_LOCAL_CLOCK_SKEW": "-30"}, name="behind")
    time.sleep(3)
    ahead.kill()
    wait_for(lambda: holder_pid(redis_client, coordination) == behind.pid, 30, message="the other skewed beat leads")
    count = len(runs(redis_client))
    wait_for(lambda: len(runs(redis_client)) >= count + 3, 30)
    behind.terminate()
    time.sleep(2)
    records = runs(redis_client)
    slots = sorted(datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in records)
    assert all((b - a) % 2 == 0 for a, b in itertools.pairwise(slots)), "left the 2 s grid"
    for r in records:
        slot = datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp()
        # published at the slot by the real clock (the catch-up after the kill may be late, never early)
        assert float(r["started"]) - slot > -1.0
    on_time = [
        float(r["started"]) - datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in records
    ]
    assert sorted(on_time)[len(on_time) // 2] < 2.0
    assert duplicates(redis_client) == {}


def test_bad_entries_are_named_and_do_not_stop_others(processes: ProcessManager, redis_client: redis.Redis) -> None:
    schedule = {
        "good": {"task": "tests.record", "every": 1, "args": ["good"]},
        "ghost": {"task": "tests.no_such_task", "every": 1},
        "bad-policy": {"task": "tests.record", "every": 1, "options": {"safe_time_misfire": "sometimes"}},
        "bad-schedule": {"task": "tests.record", "raw": "every tuesday"},
    }
    env = beat_env(schedule, safe_time_beat_lease=6)
    processes.worker(BEAT_APP, env=env, name="worker")
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    wait_for(lambda: len(runs(redis_client, "good")) >= 3, 30, message="the good entry fires")
    log = beat.log()
    assert "entry 'ghost' is disabled: unknown task 'tests.no_such_task'" in log
    assert "entry 'bad-policy' is disabled" in log
    assert "safe_time_misfire" in log
    assert "entry 'bad-schedule' is disabled" in log
    assert {r["label"] for r in runs(redis_client)} == {"good"}
    assert beat.alive()


def test_lease_shorter_than_three_ticks_is_refused(processes: ProcessManager) -> None:
    env = beat_env({}, safe_time_beat_lease=2)
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    assert beat.wait(60) != 0
    assert "safe_time_beat_lease: 2 s is shorter than 3 x the beat tick" in beat.log()


def test_invalid_crontab_in_the_app_fails_at_startup(processes: ProcessManager) -> None:
    env = beat_env({"bad": {"task": "tests.record", "cron": {"minute": "*", "tz": "Mars/Base"}}})
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    assert beat.wait(60) != 0
    assert "unknown timezone 'Mars/Base'" in beat.log()
