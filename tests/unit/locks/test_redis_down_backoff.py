"""Redis-outage re-queues of locked tasks back off, with a cap (issue 21, item 8)."""

from __future__ import annotations

import pytest

from celery_safe_time import constants as C
from celery_safe_time.config import parse_config
from celery_safe_time.locks.runtime import redis_down_cap
from celery_safe_time.requeue import backoff


def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    assert [backoff(2.0, n, 60.0) for n in range(8)] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff(2.0, 10_000, 60.0) == 60.0  # no float overflow on a long outage


def test_backoff_never_goes_below_the_base() -> None:
    assert backoff(90.0, 0, 60.0) == 90.0
    assert backoff(90.0, 5, 60.0) == 90.0
    assert backoff(1.0, -3, 60.0) == 1.0


@pytest.mark.parametrize(
    ("broker", "settings", "cap"),
    [
        ("redis://127.0.0.1:6379/0", {}, C.LOCK_REDIS_DOWN_BACKOFF_CAP),  # visibility_timeout 3600 s
        ("redis://127.0.0.1:6379/0", {"visibility_timeout": 40}, 20.0),
        ("amqp://guest@127.0.0.1//", {"safe_time_broker_consumer_timeout": 90}, 45.0),
    ],
)
def test_the_cap_stays_below_half_the_brokers_limits(broker: str, settings: dict[str, float], cap: float) -> None:
    transport = {k: v for k, v in settings.items() if k == "visibility_timeout"}
    conf = {"safe_time_redis_url": "redis://127.0.0.1:6379/0"}
    conf.update({k: v for k, v in settings.items() if k.startswith("safe_time_")})  # type: ignore[misc]
    config = parse_config(conf.get, broker_url=broker, transport_options=transport)
    assert redis_down_cap(config) == cap
