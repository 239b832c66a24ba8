"""Overlap policies on a real beat and a real prefork worker (two pool processes, so runs could
overlap): an every-1 s entry whose task takes 2.5 s.

The task records its start and its end (``test:overlap:<entry>``), and the beat app records each
first publish of a slot: the safety properties (never two runs at once, never more than one
waiting) are asserted strictly on that log; the counts loosely (the machine is shared).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from tests.helpers.beat import BEAT_APP, beat_env
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration

EVERY = 1.0
SLEEP = 2.5
TTL = 6.0
#: A run's marker moves to the lease just before the body's first line records the start: a publish
#: within this much of a start is not counted as a second waiting run.
START_GRACE = 1.0


def _events(client: redis.Redis, entry: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(f"test:overlap:{entry}", 0, -1)]


def _max_running(events: list[dict[str, Any]]) -> int:
    """The most runs between their start and their end at once (the list is in Redis's order)."""
    running: set[str] = set()
    most = 0
    for event in events:
        if event["event"] == "start":
            running.add(event["task_id"])
            most = max(most, len(running))
        elif event["event"] == "end":
            running.discard(event["task_id"])
    return most


def _max_waiting(events: list[dict[str, Any]]) -> int:
    """The most runs published and not started at any publish (a start within START_GRACE counts)."""
    starts = {e["task_id"]: e["at"] for e in events if e["event"] == "start"}
    published: list[tuple[str, float]] = []
    most = 0
    for event in events:
        if event["event"] != "publish":
            continue
        at = event["at"]
        published.append((event["task_id"], at))
        waiting = [tid for tid, _ in published if starts.get(tid, float("inf")) > at + START_GRACE]
        most = max(most, len(waiting))
    return most


def _ended(events: list[dict[str, Any]]) -> int:
    return sum(e["event"] == "end" for e in events)


def _start(
    processes: ProcessManager, entry: str, policy: str, coordination: dict[str, Any], **spec: Any
) -> tuple[CeleryProcess, CeleryProcess, dict[str, str]]:
    schedule = {
        entry: {
            "task": "tests.overlap_run",
            "every": spec.pop("every", EVERY),
            "args": [entry, spec.pop("sleep", SLEEP)],
            "overlap": policy,
            "overlap_ttl": spec.pop("ttl", TTL),
        }
    }
    env = beat_env(schedule, safe_time_beat_lease=3, **coordination)
    worker = processes.worker(BEAT_APP, env=env, name="worker", concurrency=2)
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    return worker, beat, env


def test_skip_runs_one_at_a_time_and_drops_the_slots_meanwhile(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    _, beat, _ = _start(processes, "skipper", "skip", coordination)
    wait_for(lambda: _ended(_events(redis_client, "skipper")) >= 4, 40, message="four runs")
    beat.terminate()
    events = _events(redis_client, "skipper")
    assert _max_running(events) == 1, events
    published = sum(e["event"] == "publish" for e in events)
    dropped = len(beat.log().split("dropped (overlap skip")) - 1
    starts = sum(e["event"] == "start" for e in events)
    # a 2.5 s run on a 1 s grid: about two slots dropped per run (loosely: at least one per run after the first)
    assert dropped >= starts - 1, (dropped, starts)
    assert published <= starts + 1, (published, starts)


def test_buffer_one_keeps_at_most_one_run_waiting(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    _, beat, _ = _start(processes, "buffered", "buffer_one", coordination)
    wait_for(lambda: _ended(_events(redis_client, "buffered")) >= 4, 40, message="four runs")
    beat.terminate()
    events = _events(redis_client, "buffered")
    assert _max_running(events) == 1, events
    assert _max_waiting(events) <= 1, events
    assert "dropped (overlap buffer_one: a run is queued)" in beat.log()
    # the waiting run starts as the running one ends (it re-checks every second at most)
    starts = [e["at"] for e in events if e["event"] == "start"]
    ends = [e["at"] for e in events if e["event"] == "end"]
    gaps = [b - a for a, b in zip(ends, starts[1:], strict=False)]
    assert gaps, events
    assert min(gaps) < 1.5, gaps


def test_cancel_other_terminates_the_running_run_before_the_next_starts(
    processes: ProcessManager, redis_client: redis.Redis
) -> None:
    _, beat, _ = _start(processes, "canceller", "cancel_other", {}, every=2.0, sleep=5.0)
    wait_for(
        lambda: sum(e.get("outcome") == "RunCancelled" for e in _events(redis_client, "canceller")) >= 3,
        40,
        message="three cancelled runs",
    )
    beat.terminate()
    events = _events(redis_client, "canceller")
    assert _max_running(events) == 1, events
    assert "terminating its running run" in beat.log()


def test_a_run_killed_with_its_worker_frees_the_entry_within_its_ttl(
    processes: ProcessManager, redis_client: redis.Redis
) -> None:
    ttl = 3.0
    worker, _, env = _start(processes, "killed", "skip", {}, sleep=60.0, ttl=ttl)
    wait_for(lambda: _events(redis_client, "killed") and _events(redis_client, "killed")[-1]["event"] == "start", 30,
             message="a run")  # fmt: skip
    worker.kill()  # kill -9 of the worker and its pool processes, mid-run
    killed_at = time.time()
    processes.worker(BEAT_APP, env=env, name="second")

    def restarted() -> float | None:
        return next(
            (e["at"] for e in _events(redis_client, "killed") if e["event"] == "start" and e["at"] > killed_at), None
        )

    started = wait_for(restarted, 30, message="a run after the kill")
    # the lease expires ttl after its last renewal (at most ttl/3 before the kill); then the next
    # slot (1 s), the new worker's start and its pickup
    assert started - killed_at < ttl + EVERY + 6.0, started - killed_at
    assert _max_running(_events(redis_client, "killed")) >= 1


def test_buffer_all_runs_every_slot_one_at_a_time_in_order(
    processes: ProcessManager, redis_client: redis.Redis
) -> None:
    _, beat, _ = _start(processes, "everything", "buffer_all", {}, sleep=1.5)
    wait_for(lambda: _ended(_events(redis_client, "everything")) >= 5, 40, message="five runs")
    beat.terminate()
    events = _events(redis_client, "everything")
    assert _max_running(events) == 1, events
    published = [e["task_id"] for e in events if e["event"] == "publish"]
    started = [e["task_id"] for e in events if e["event"] == "start"]
    # every slot published, and the runs start in the order of their slots
    assert started == published[: len(started)], (published, started)
    assert len(published) > len(started), (published, started)  # a 1.5 s run on a 1 s grid falls behind
    assert "dropped (overlap" not in beat.log()


def test_beat_add_takes_an_overlap_policy_and_list_and_show_give_it(processes: ProcessManager) -> None:
    from tests.integration.beat.test_entries_cli import _beat

    added = _beat(processes, {}, "add", "exports", "tests.record", "--every", "60", "--overlap", "buffer_one",
                  "--overlap-ttl", "90")  # fmt: skip
    assert added.returncode == 0, added.stderr
    shown = _beat(processes, {}, "show", "exports")
    assert json.loads(shown.stdout)["options"] == {"safe_time_overlap": "buffer_one", "safe_time_overlap_ttl": 90.0}
    listed = _beat(processes, {}, "list")
    assert ["exports", "runtime", "enabled/buffer_one"] in [line.split()[:3] for line in listed.stdout.splitlines()]
    bad = _beat(processes, {}, "add", "bad", "tests.record", "--every", "60", "--overlap", "sometimes")
    assert bad.returncode != 0
    assert "'sometimes' is not one of 'allow', 'skip', 'buffer_one', 'buffer_all', 'cancel_other'" in bad.stderr
