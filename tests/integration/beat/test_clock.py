"""Beat's "now" against a real Redis while this host's wall clock steps (NTP, an operator)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_safe_time import clock as clock_module
from celery_safe_time import signals
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.clock import RedisClock, local_time
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


# +/-1 h, and +/-20 s: a step shorter than the refresh that no resync corrects
@pytest.mark.parametrize("step", [3600.0, -3600.0, 20.0, -20.0])
def test_redis_clock_ignores_a_wall_clock_step_between_syncs(redis_client: redis.Redis, step: float) -> None:
    stepped = [0.0]

    def wall() -> float:
        return local_time() + stepped[0]

    clock = RedisClock(redis_client, refresh=60, local=wall)
    assert abs(clock.time() - redis_now(redis_client)) < 0.5
    stepped[0] = step
    assert abs(clock.time() - redis_now(redis_client)) < 0.5
    time.sleep(0.3)
    assert abs(clock.time() - redis_now(redis_client)) < 0.5


def _noop() -> None:
    return None


def test_a_wall_clock_step_neither_fires_early_nor_misses(
    make_app: Any, tmp_path: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(safe_time_beat_lease=3, beat_schedule={"e": {"task": "t.noop_clock", "schedule": 1.0}})
    app.task(name="t.noop_clock")(_noop)
    fired: list[tuple[float, float]] = []  # (slot, Redis TIME when it was published)

    def on_sent(sender: Any, **kw: Any) -> None:
        fired.append((kw["slot"].timestamp(), redis_now(redis_client)))

    def run_ticks(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(max(sched.tick(), 0.01), 0.2))

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        wait_for(lambda: (sched.tick(), fired)[1], 10, message="a first slot")
        # SAFE_TIME_LOCAL_CLOCK_SKEW's value, read by local_time() on every call: a wall-clock step
        for step in (20.0, 3600.0, -3600.0):  # shorter than the 30 s refresh, then +/-1 h
            monkeypatch.setattr(clock_module, "_SKEW", step)
            run_ticks(2.5)
    finally:
        sched.close()
        signals.beat_slot_dispatched.disconnect(on_sent)
    slots = [slot for slot, _ in fired]
    assert len(slots) >= 6, fired
    assert [b - a for a, b in itertools.pairwise(slots)] == [1.0] * (len(slots) - 1), "missed a slot"
    early = [(slot, at) for slot, at in fired if at < slot - 0.05]
    assert not early, f"published before their slot: {early}"
