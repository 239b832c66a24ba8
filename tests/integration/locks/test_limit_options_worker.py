"""``safe_time_rate_limit`` and ``safe_time_concurrency_limit`` as SafeTask options on real prefork workers:
the rate holds across two workers, a full key conflicts, and a killed holder's slot frees within its ttl."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time.locks.backends import get_lock_backend
from tests.helpers import locks as h
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def test_the_rate_option_holds_across_two_prefork_workers(
    processes: ProcessManager, redis_client: redis.Redis, redis_url: str
) -> None:
    env = h.broker_env(redis_url, redis_url)
    env["SAFE_TIME_TEST_RATE"] = "10/s"
    h.start_worker(processes, name="opt-rate-a", concurrency=4, env=env)
    h.start_worker(processes, name="opt-rate-b", concurrency=4, env=env)
    client_app = h.client_app(redis_url)
    total = 50
    for n in range(total):  # a burst: 10 start at once, the other 40 wait for their places
        client_app.send_task("locks.rated_option", args=("burst", n))
    wait_for(lambda: redis_client.llen("test:locks:rated") >= total, 60, message=f"{total} runs")
    time.sleep(0.3)  # nothing more may start: each call runs once
    runs = [json.loads(raw) for raw in redis_client.lrange("test:locks:rated", 0, -1)]
    assert sorted(r["n"] for r in runs) == list(range(total))
    admitted = [s for s in h.signals(redis_client, "rate_limit_admitted") if s["key"] == "rated-option:burst"]
    assert len(admitted) == total
    # The safety bound on the backend's clock, where the limit decides; the rate it reaches is the
    # benchmark's business (benchmarks/flow.py).
    assert h.most_in_any_window([s["started_at"] for s in admitted], 1.0) <= 10
    limited = [s for s in h.signals(redis_client, "rate_limited") if s["key"] == "rated-option:burst"]
    assert len(limited) >= total - 10
    client_app.close()


def test_the_concurrency_option_conflicts_when_full_and_a_kill_9_frees_its_slots(
    processes: ProcessManager,
    redis_client: redis.Redis,
    redis_url: str,
    make_app: Callable[..., Celery],
) -> None:
    ttl = 2.0
    env = h.broker_env(redis_url, redis_url, safe_time_lock_ttl=ttl)
    store = get_lock_backend(make_app())
    worker = h.start_worker(processes, name="opt-slots", concurrency=4, env=env)
    client_app = h.client_app(redis_url)
    holders = [client_app.send_task("locks.slots_option", args=("crash", 60)) for _ in range(4)]

    def started() -> list[Any]:
        return [run for run in holders if redis_client.get(f"test:locks:started:{run.id}")]

    wait_for(lambda: len(started()) == 3, 30, message="three holders started")

    def conflicts() -> list[dict[str, Any]]:
        return [s for s in h.signals(redis_client, "overlap_conflict") if s["key"] == "slots-option:crash"]

    wait_for(conflicts, 30, message="the fourth call found every slot taken")
    assert len(started()) == 3
    slots = [f"slot:slots-option:crash#{n}" for n in range(3)]
    assert {store.holder_record(slot)[1] for slot in slots} == {run.id for run in started()}  # type: ignore[index]
    killed = time.monotonic()
    worker.kill()
    wait_for(lambda: all(store.token_of(slot) is None for slot in slots), ttl + 3, message="slots freed after kill -9")
    assert time.monotonic() - killed <= ttl + 1.0
    client_app.close()
