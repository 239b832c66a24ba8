"""The adaptive look-ahead (pure) and its bounds in the config."""

from __future__ import annotations

import pytest

from celery_safe_time import constants as C
from celery_safe_time.config import parse_config
from celery_safe_time.delays.plan import adaptive_lookahead
from celery_safe_time.exceptions import ImproperlyConfigured


def test_a_small_backlog_keeps_the_fixed_lookahead() -> None:
    assert adaptive_lookahead(0, 1000.0, base=2.0, ceiling=300.0) == 2.0
    assert adaptive_lookahead(10, 1000.0, base=2.0, ceiling=300.0) == pytest.approx(2.02)


def test_a_burst_is_claimed_twice_its_publishing_time_early() -> None:
    # 100,000 rows at 5,000 rows/s take 20 s: claiming starts 40 s (plus the base) before they are due.
    assert adaptive_lookahead(100_000, 5000.0, base=2.0, ceiling=300.0) == pytest.approx(42.0)


def test_a_burst_gets_one_sweep_interval_more_a_small_backlog_does_not() -> None:
    assert adaptive_lookahead(100_000, 5000.0, base=2.0, ceiling=300.0, interval=5.0) == pytest.approx(47.0)
    assert adaptive_lookahead(100, 5000.0, base=2.0, ceiling=300.0, interval=5.0) == pytest.approx(2.04)


def test_the_broker_window_caps_it() -> None:
    assert adaptive_lookahead(1_000_000, 100.0, base=2.0, ceiling=180.0) == 180.0


def test_the_row_limit_stops_it_at_the_last_counted_row() -> None:
    assert adaptive_lookahead(1000, 10.0, base=2.0, ceiling=300.0, limit_reached_in=30.0) == 30.0
    # never below the base, even when the limit is reached by overdue rows
    assert adaptive_lookahead(1000, 10.0, base=2.0, ceiling=300.0, limit_reached_in=-5.0) == 2.0


def test_a_zero_rate_does_not_divide_by_zero() -> None:
    assert adaptive_lookahead(5, 0.0, base=2.0, ceiling=300.0) == 12.0


def test_the_ceiling_is_a_tenth_of_the_visibility_or_consumer_timeout() -> None:
    redis = parse_config({}.get, broker_url="redis://h/0", transport_options={"visibility_timeout": 600})
    assert redis.sweep_lookahead_max == 60.0
    assert parse_config({}.get, broker_url="redis://h/0").sweep_lookahead_max == C.SWEEP_LOOKAHEAD_MAX
    amqp = parse_config({"safe_time_redis_url": "redis://h/0"}.get, broker_url="amqp://h//")
    assert amqp.sweep_lookahead_max == 180.0  # consumer_timeout 1800 s
    short = parse_config(
        {"safe_time_redis_url": "redis://h/0", "safe_time_broker_consumer_timeout": 8, "safe_time_lock_ttl": 4}.get,
        broker_url="amqp://h//",
    )
    assert short.sweep_lookahead_max == short.sweep_lookahead == 0.8


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_sweep_max_ahead_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ImproperlyConfigured, match="safe_time_sweep_max_ahead"):
        parse_config({"safe_time_sweep_max_ahead": bad}.get, broker_url="redis://h/0")
