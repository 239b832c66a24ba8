"""Issue 38 part 3, one way to wait: a gate's re-queue goes to the broker only with a countdown below
the delay threshold; a longer wait goes through the durable store, for plain tasks too, and keeps its
place in the limit. Real prefork workers, a Redis broker with a short visibility timeout (and
RabbitMQ, and the local SQS endpoint), the sweep of the store run by this process."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from tests.helpers import locks as h
from tests.helpers import services
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

#: The rate under test and its period: every wait after the first call is a multiple of it, all
#: longer than the delay threshold (half the visibility timeout).
RATE, PERIOD = "1/3s", 3.0
VISIBILITY_TIMEOUT = 4
CALLS = 6


def _rated(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange("test:locks:rated", 0, -1)]


@pytest.mark.parametrize(
    ("broker_url", "installed"),
    [("redis", True), ("redis", False), ("amqp", True), ("sqs", True)],
    indirect=["broker_url"],
)
def test_rate_limit_waits_past_the_visibility_timeout_run_each_call_once(
    processes: ProcessManager,
    make_app: Callable[..., Celery],
    broker_url: str,
    installed: bool,
    redis_url: str,
    redis_client: redis.Redis,
    sqlite_url: str,
) -> None:
    """Plain task, ``@rate_limit("1/3s")``, 6 calls, visibility timeout 4 s. Before: the limiter sent
    countdowns of up to 15 s through the broker, which restored each one after 4 s as a new call:
    17 runs in 50 s. Now each wait over the threshold is a stored row: 6 calls run 6 times, one per
    period. Without ``install(app)`` (no sweep to send a stored row) each long wait comes back after
    the threshold and waits again: the same 6 runs."""
    conf: dict[str, Any] = {
        "result_backend": redis_url,
        "safe_time_redis_url": redis_url,
        "safe_time_store_url": sqlite_url,
    }
    if broker_url.startswith("redis"):
        conf["broker_transport_options"] = {"visibility_timeout": VISIBILITY_TIMEOUT, **services.REDIS_FAST_RESTORE}
    elif broker_url.startswith("sqs"):
        # SQS hands a message held past its visibility timeout out again by itself
        conf.update(services.broker_conf(broker_url, visibility_timeout=VISIBILITY_TIMEOUT))
    else:
        # RabbitMQ closes the channel of a consumer holding a message past its consumer timeout: the
        # same rule (the threshold is half of it).
        conf["safe_time_broker_consumer_timeout"] = VISIBILITY_TIMEOUT
        conf["safe_time_lock_ttl"] = VISIBILITY_TIMEOUT  # its re-checks wait ttl/2, below that timeout too
    env = {
        "SAFE_TIME_TEST_BROKER_URL": broker_url,
        "SAFE_TIME_TEST_REDIS_URL": redis_url,
        "SAFE_TIME_TEST_STORE_URL": sqlite_url,
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
        "SAFE_TIME_TEST_RATE": RATE,
    }
    if installed:
        env["SAFE_TIME_TEST_INSTALL"] = "1"
    h.start_worker(processes, name="waits", concurrency=2, env=env)
    app = make_app("gate-waits", broker_url=broker_url, **conf)

    # shared=False: a shared task joins every app finalized later in the session, and this test's
    # parameters would each add another callable under one name (DuplicateTaskNameWarning).
    @app.task(name="locks.rated", shared=False)
    def rated(key: str, n: int) -> None:  # the sweep publishes by name: it only needs to know it
        raise AssertionError("runs on the worker")

    for n in range(CALLS):
        app.send_task("locks.rated", args=("vt", n))

    def swept_all() -> bool:
        sweep(app)
        return len(_rated(redis_client)) >= CALLS

    # Six calls one period apart take 15 s; the machine is shared, so allow for a slow worker.
    wait_for(swept_all, 90, interval=0.3, message=f"{CALLS} rated runs")
    # Keep sweeping past the visibility timeout (twice over): a copy restored by the broker, or a row
    # published again, would run now.
    until = time.monotonic() + 3 * VISIBILITY_TIMEOUT
    while time.monotonic() < until:
        sweep(app)
        time.sleep(0.3)

    runs = _rated(redis_client)
    assert sorted(r["n"] for r in runs) == list(range(CALLS)), runs
    starts = sorted(r["at"] for r in runs)
    # One start per period at most: the waits kept their places (measured on one worker's clock,
    # with a little room for when the body records its start).
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) > PERIOD - 0.5, gaps
    # Every wait after the first call was longer than the threshold: it went through the store (or,
    # without the sweep, hopped through the broker at the threshold).
    stored = [row for row in get_store(app).list(limit=100) if row.task == "locks.rated"]
    assert len(stored) >= CALLS - 1 if installed else not stored, stored
