"""``RedisClock`` with injected clocks: Redis ``TIME``, this host's wall clock and its monotonic clock."""

from __future__ import annotations

from typing import Any, cast

import pytest
import redis

from celery_safe_time.clock import RedisClock
from celery_safe_time.exceptions import RedisUnavailable


class Clocks:
    """One true time with three views: Redis ``TIME`` (the truth), a wall clock that can be stepped,
    and a monotonic clock with its own origin. ``time()`` makes it stand in for the Redis client."""

    def __init__(self) -> None:
        self.true = 1_800_000_000.0
        self.wall_error = 0.0
        self.redis_down = False
        self.reads = 0

    def advance(self, seconds: float) -> None:
        self.true += seconds

    def wall(self) -> float:
        return self.true + self.wall_error

    def monotonic(self) -> float:
        return self.true - 1_799_990_000.0  # any origin: only differences count

    def time(self) -> tuple[int, int]:  # the Redis client's TIME
        if self.redis_down:
            raise redis.ConnectionError("down")
        self.reads += 1
        seconds = int(self.true)
        return seconds, round((self.true - seconds) * 1e6)


def clock_for(clocks: Clocks, refresh: float = 30.0) -> RedisClock:
    return RedisClock(cast(Any, clocks), refresh=refresh, local=clocks.wall, monotonic=clocks.monotonic)


# +/-1 h, and +/-20 s: a step shorter than the refresh that no resync corrects
@pytest.mark.parametrize("step", [3600.0, -3600.0, 20.0, -20.0])
def test_a_wall_clock_step_between_syncs_changes_nothing(step: float) -> None:
    clocks = Clocks()
    clock = clock_for(clocks)
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)
    clocks.advance(5)
    clocks.wall_error += step  # NTP steps this host's clock
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)
    clocks.advance(20)
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)
    assert clocks.reads == 3  # one sync (3 samples): the step did not force or delay one


def test_refresh_is_timed_on_the_monotonic_clock() -> None:
    clocks = Clocks()
    clock = clock_for(clocks, refresh=30)
    clock.time()
    reads = clocks.reads
    clocks.wall_error = -3600.0  # would postpone a wall-clock-timed refresh by an hour
    clocks.advance(29)
    clock.time()
    assert clocks.reads == reads
    clocks.advance(2)
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)
    assert clocks.reads > reads


def test_offset_still_reports_the_wall_clock_error() -> None:
    # what the startup warning and `safe-time check` show (SAFE_TIME_LOCAL_CLOCK_SKEW in drills)
    clocks = Clocks()
    clocks.wall_error = 300.0
    clock = clock_for(clocks)
    offset = clock.sync()
    assert offset.offset == pytest.approx(-300.0, abs=1e-3)
    assert offset.rtt == pytest.approx(0.0, abs=1e-6)
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)


def test_a_failed_refresh_keeps_interpolating_from_the_last_sync() -> None:
    clocks = Clocks()
    clock = clock_for(clocks, refresh=30)
    clock.time()
    clocks.redis_down = True
    clocks.advance(45)
    clocks.wall_error = 3600.0
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)
    clocks.redis_down = False
    clocks.advance(31)
    reads = clocks.reads
    assert clock.time() == pytest.approx(clocks.true, abs=1e-3)
    assert clocks.reads > reads


def test_no_sync_yet_and_redis_down_raises() -> None:
    clocks = Clocks()
    clocks.redis_down = True
    with pytest.raises(RedisUnavailable):
        clock_for(clocks).time()
