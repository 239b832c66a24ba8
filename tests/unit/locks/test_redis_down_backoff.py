"""Redis-outage re-queues of locked tasks back off, with a cap (issue 21, item 8)."""

from __future__ import annotations

import pytest

from celery_safe_time import constants as C
from celery_safe_time.config import parse_config
from celery_safe_time.locks.runtime import backend_down_cap
from celery_safe_time.messages.requeue import outage_backoff


def test_a_fresh_outage_waits_the_base_then_half_the_outage_so_far() -> None:
    assert outage_backoff(2.0, 0.0, 60.0) == 2.0
    assert outage_backoff(2.0, 3.0, 60.0) == 2.0  # a blip: nothing more than retry_after
    assert outage_backoff(2.0, 10.0, 60.0) == 5.0
    assert outage_backoff(2.0, 100.0, 60.0) == 50.0
    assert outage_backoff(2.0, 3600.0, 60.0) == 60.0


def test_waits_grow_about_one_and_a_half_times_per_requeue_up_to_the_cap() -> None:
    age, waits = 0.0, []
    for _ in range(15):
        wait = outage_backoff(1.0, age, 60.0)
        waits.append(wait)
        age += wait
    assert waits[:3] == [1.0, 1.0, 1.0]
    assert waits == sorted(waits)
    assert waits[-1] == 60.0
    assert sum(waits[:8]) < 30  # eight re-queues in the first half minute; before: 20 to 30 of them


def test_never_below_the_base_even_with_a_skewed_clock() -> None:
    assert outage_backoff(90.0, 500.0, 60.0) == 90.0
    assert outage_backoff(1.0, -30.0, 60.0) == 1.0  # "since" from a worker whose clock is ahead


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
    conf: dict[str, object] = {"safe_time_redis_url": "redis://127.0.0.1:6379/0"}
    conf.update({k: v for k, v in settings.items() if k.startswith("safe_time_")})
    config = parse_config(conf.get, broker_url=broker, transport_options=transport)
    assert backend_down_cap(config) == cap
