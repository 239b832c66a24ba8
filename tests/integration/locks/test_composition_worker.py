"""Stacked gates on real prefork workers (issue 38), with the locks on Redis and on PostgreSQL: a rate
limit's re-queue inside an outer gate is not a finish, and a redelivered copy of a running message
under ``concurrency_limit`` finds the slot its original holds (the in-process matrix:
tests/unit/locks/test_composition.py)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish

from celery_safe_time import constants as C
from celery_safe_time.locks.backends import Owner, get_lock_backend
from tests.helpers import locks as h
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

REDIS_AND_POSTGRES = pytest.mark.parametrize("coordination_conf", ["redis", "postgres"], indirect=True)


@REDIS_AND_POSTGRES
@pytest.mark.parametrize("task", ["locks.lock_over_rate", "locks.slots_over_rate"])
def test_an_outer_gate_over_a_rate_limit_runs_every_call(
    processes: ProcessManager, redis_client: redis.Redis, redis_url: str, coordination_conf: dict[str, Any], task: str
) -> None:
    """4 calls of one key, ``1/3s`` inside ``overlap_lock`` / ``concurrency_limit(limit=2)``: 4 runs, each
    once, none dropped as "already ran"."""
    env = h.broker_env(redis_url, redis_url, coordination=coordination_conf)
    worker = h.start_worker(processes, name="stacked", concurrency=4, ttl=5.0, retry_after=0.5, env=env)
    client_app = h.client_app(redis_url)
    try:
        results = [client_app.send_task(task, args=("k", n)) for n in range(4)]
        assert sorted(r.get(timeout=60) for r in results) == [0, 1, 2, 3]
        time.sleep(1.0)  # nothing else may run
        name = task.split(".")[1]
        runs = h.runs(redis_client, name)
        assert sorted(r["n"] for r in runs) == [0, 1, 2, 3]
        starts = sorted(r["started"] for r in runs)
        # 1/3s: the limit holds across the re-queues (a little slack for the clocks of two processes)
        assert all(b - a > 2.5 for a, b in itertools.pairwise(starts)), starts
        assert not [s for s in h.signals(redis_client, "overlap_conflict") if s["action"] == "finished"]
        assert "dropping a redelivered copy" not in worker.log()
    finally:
        client_app.close()


@pytest.fixture
def fixed_attempt() -> Iterator[str]:
    """The attempt token (the delivery identity) the next publish of this process carries: set after
    the package's own stamp, so the test knows which slot the delivery asks first."""
    attempt = f"composition-{uuid.uuid4().hex}"

    def stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers is not None:
            headers[C.HEADER_ATTEMPT] = attempt

    before_task_publish.connect(stamp, weak=False)
    try:
        yield attempt
    finally:
        before_task_publish.disconnect(stamp)


@REDIS_AND_POSTGRES
def test_a_redelivered_copy_never_runs_beside_its_original_in_another_slot(
    processes: ProcessManager,
    redis_client: redis.Redis,
    redis_url: str,
    coordination_conf: dict[str, Any],
    make_app: Callable[..., Celery],
    fixed_attempt: str,
) -> None:
    """``concurrency_limit(limit=2)``, ``acks_late``, visibility timeout 4 s, a 10 s body that holds the
    slot its copy does not ask first: the copies the broker hands out while it runs are duplicates
    (re-queued, then dropped), never a second run in the free slot. One message, one run."""
    env = h.broker_env(redis_url, redis_url, visibility_timeout=4, coordination=coordination_conf)
    store = get_lock_backend(make_app(**coordination_conf))
    home = f"long-slot:k#{zlib.crc32(fixed_attempt.encode()) % 2}"
    blocker = Owner(task_id="blocker", identity="blocker", host="test", pid=0)
    assert store.acquire(home, "blocker-token", 30.0, blocker).status == "acquired"
    worker = h.start_worker(processes, name="long-slot", concurrency=4, ttl=6.0, retry_after=0.5, env=env)
    client_app = h.client_app(redis_url)
    try:
        result = client_app.send_task("locks.long_slot", args=("k", 10.0))
        wait_for(lambda: redis_client.llen(h.STARTS) >= 1, 30, message="the original started")
        assert store.release(home, "blocker-token")  # the slot its copy asks first is free from here on
        assert result.get(timeout=60) != home
        # The broker restores the unacked message every ~4 s while the body runs: each copy is a duplicate.
        wait_for(
            lambda: [s for s in h.signals(redis_client, "overlap_conflict") if s["action"] == "duplicate"],
            20,
            message="a copy to meet its running original",
        )
        time.sleep(6.0)  # the re-queued copies come back after the original finished: dropped
        starts = [json.loads(raw) for raw in redis_client.lrange(h.STARTS, 0, -1)]
        assert [s["task_id"] for s in starts] == [result.id], starts
        assert len(h.runs(redis_client, "long_slot")) == 1
        assert "dropping a redelivered copy of " + result.id in worker.log()
    finally:
        client_app.close()
