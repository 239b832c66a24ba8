"""``rate_limit`` and ``concurrency_limit`` on real prefork workers: a global rate across two workers, at
most ``limit`` runs at once, and a killed holder's slot freed within its ttl; on Redis and PostgreSQL."""

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

REDIS_AND_POSTGRES = pytest.mark.parametrize("coordination_conf", ["redis", "postgres"], indirect=True)


def _rated(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange("test:locks:rated", 0, -1)]


@REDIS_AND_POSTGRES
def test_a_global_rate_across_two_prefork_workers(
    processes: ProcessManager, redis_client: redis.Redis, redis_url: str, coordination_conf: dict[str, Any]
) -> None:
    """20/s over two workers of 4 processes each: no 1 s window holds more than 20 starts (nor 10 s more
    than 200), every call runs exactly once, and the waiting calls' lateness is reported. How close the
    rate comes to the limit depends on the CPU the workers get (the suite shares two cores with other
    tests): ``make bench`` measures it (``benchmarks/flow.py``), not this test."""
    env = h.broker_env(redis_url, redis_url, coordination=coordination_conf)
    env["SAFE_TIME_TEST_RATE"] = "20/s"
    h.start_worker(processes, name="rate-a", concurrency=4, env=env)
    h.start_worker(processes, name="rate-b", concurrency=4, env=env)
    client_app = h.client_app(redis_url)
    # A producer faster than the limit (30/s), as in production: the queue never holds a long
    # backlog of first deliveries in front of the re-queued calls.
    total = 330
    sending_since = time.monotonic()
    for n in range(total):
        client_app.send_task("locks.rated", args=("global", n))
        time.sleep(1 / 30)
    sending = time.monotonic() - sending_since  # 11 s, or longer on a loaded machine
    wait_for(lambda: redis_client.llen("test:locks:rated") >= total, 90, message=f"{total} rated runs")
    time.sleep(0.5)  # nothing more may start: each call runs once
    runs = _rated(redis_client)
    assert sorted(r["n"] for r in runs) == list(range(total))
    # Starts on the backend's clock, where the limit decides (a body's own clock reading comes after
    # the admission by a few ms or, on a loaded machine, tens of ms).
    admitted = h.signals(redis_client, "rate_limit_admitted")
    starts = sorted(s["started_at"] for s in admitted)
    in_ten_seconds = sum(1 for s in starts if s < starts[0] + 10.0)
    print(f"starts in the first 10 s: {in_ten_seconds} (limit 20/s)")
    assert in_ten_seconds <= 200, in_ten_seconds
    assert h.most_in_any_window(starts, 1.0) <= 20
    assert len({r["task_id"] for r in runs}) == total
    lateness = [s["lateness"] for s in admitted]
    assert len(lateness) == total
    waited = sum(1 for r in runs if int(r["requeues"]) > 0)
    assert waited >= total - 20 * 17  # at least what 17 s at the limit cannot hold
    assert sum(1 for late in lateness if late > 0) == waited
    # The last calls wait at least as long as the queue in front of them takes at the limit, counted
    # from when the last one was sent (a slow producer builds a shorter queue).
    assert max(lateness) >= (total - 20) / 20 - sending - 1.0
    client_app.close()


@REDIS_AND_POSTGRES
def test_limit_3_never_has_4_running(
    processes: ProcessManager, redis_client: redis.Redis, redis_url: str, coordination_conf: dict[str, Any]
) -> None:
    env = h.broker_env(redis_url, redis_url, coordination=coordination_conf)
    h.start_worker(processes, name="slots-a", concurrency=4, ttl=3.0, retry_after=0.2, env=env)
    h.start_worker(processes, name="slots-b", concurrency=4, ttl=3.0, retry_after=0.2, env=env)
    client_app = h.client_app(redis_url)
    results = [client_app.send_task("locks.slots", args=("tenant", 1.0)) for _ in range(12)]
    other = client_app.send_task("locks.slots", args=("other", 0.1))
    done = h.wait_runs(redis_client, "slots", 13, timeout=120)
    assert all(r.get(timeout=30).startswith("slot:slots:tenant#") for r in results)
    assert other.get(timeout=30).startswith("slot:slots:other#")  # another key has slots of its own
    intervals = [(r["started"], r["finished"]) for r in done if r["key"] == "tenant"]
    assert len(intervals) == 12
    most = h.most_at_once(intervals)
    assert most == 3, f"at most 3 at once (and 3 reached), saw {most}"
    by_slot: dict[str, list[tuple[float, int]]] = {}
    for r in done:
        if r["key"] == "tenant":
            by_slot.setdefault(r["slot"], []).append((r["started"], r["fence"]))
    assert set(by_slot) <= {"slot:slots:tenant#0", "slot:slots:tenant#1", "slot:slots:tenant#2"}
    for slot, held in by_slot.items():
        fences = [fence for _, fence in sorted(held)]
        assert fences == sorted(set(fences)), f"slot {slot}: fences grow with its holders"
    client_app.close()


@pytest.mark.parametrize("coordination_conf", ["redis", "postgres"], indirect=True)
def test_kill_9_frees_a_holders_slot_within_its_ttl(
    processes: ProcessManager,
    redis_client: redis.Redis,
    redis_url: str,
    coordination_conf: dict[str, Any],
    make_app: Callable[..., Celery],
) -> None:
    ttl = 2.0
    env = h.broker_env(redis_url, redis_url, coordination=coordination_conf)
    store = get_lock_backend(make_app(**coordination_conf))
    worker = h.start_worker(processes, name="slots-killed", concurrency=4, ttl=ttl, env=env)
    client_app = h.client_app(redis_url)
    holders = [client_app.send_task("locks.slots", args=("crash", 60)) for _ in range(3)]
    for run in holders:
        wait_for(lambda run=run: redis_client.get(f"test:locks:started:{run.id}"), 30, message="holder started")
    slots = [f"slot:slots:crash#{n}" for n in range(3)]
    assert {store.holder_record(slot)[1] for slot in slots} == {run.id for run in holders}  # type: ignore[index]
    killed = time.monotonic()
    worker.kill()
    wait_for(lambda: all(store.token_of(slot) is None for slot in slots), ttl + 3, message="slots freed after kill -9")
    assert time.monotonic() - killed <= ttl + 1.0
    h.start_worker(processes, name="slots-after", concurrency=4, ttl=ttl, env=env)
    again = client_app.send_task("locks.slots", args=("crash", 0.1))
    assert again.get(timeout=30) in slots
    client_app.close()


def test_a_hard_time_limit_frees_the_slot_long_before_its_ttl(
    processes: ProcessManager, redis_client: redis.Redis, redis_url: str, make_app: Callable[..., Celery]
) -> None:
    store = get_lock_backend(make_app())
    h.start_worker(processes, name="slots-hard", concurrency=2, ttl=60.0)
    client_app = h.client_app(redis_url)
    run = client_app.send_task("locks.slots", args=("hard", 60), time_limit=2)
    wait_for(lambda: redis_client.get(f"test:locks:started:{run.id}"), 30, message="holder started")
    slots = [f"slot:slots:hard#{n}" for n in range(3)]
    [held] = [slot for slot in slots if store.token_of(slot) is not None]
    run.get(timeout=30, propagate=False)
    assert run.state == "FAILURE"
    wait_for(lambda: store.token_of(held) is None, 15, message="slot freed after the hard time limit")
    client_app.close()
