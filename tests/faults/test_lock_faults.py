"""Locks under the faults production brings: an empty script cache, a connection the server closed
while the body ran. A release or an idempotency commit sent without waiting is settled before the
delivery ends, so it is never lost. Real workers, a redis-server of the test's own for the locks."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from tests.faults.redis_faults import close_idle_connections, empty_script_cache
from tests.helpers import locks as h
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration


def _locks_worker(processes: ProcessManager, redis_url: str, server: RedisServer, ttl: float) -> None:
    """A worker whose broker, results and records are on the test's Redis db and whose locks are on
    ``server`` (the faults touch only that one)."""
    env = h.broker_env(redis_url, redis_url, coordination={"safe_time_redis_url": server.url})
    h.start_worker(processes, ttl=ttl, concurrency=2, env=env)


def _marker_written(server: RedisServer, key: str) -> bool:
    client = redis.Redis.from_url(server.url)
    try:
        return bool(client.exists(f"safe_time:idem:{key}"))
    finally:
        client.close()


FAULTS: dict[str, Callable[[RedisServer], None]] = {
    "cold script cache": empty_script_cache,
    "idle connections closed": lambda server: close_idle_connections(server, 2),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_idempotent_commit_sent_without_waiting_is_settled_before_the_task_ends(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis, redis_server: RedisServer, fault: str
) -> None:
    """``@idempotent(ttl=3)``, a 5 s body, then a second call after the ttl: one run. The commit is
    posted as the body returns; with an empty script cache Redis answers ``NOSCRIPT``, and a kept
    connection the server closed during the body (idle ``timeout`` 2 s) runs nothing. Either way
    the marker is written before the task ends, not at that pool child's next lock call."""
    _locks_worker(processes, redis_url, redis_server, ttl=3.0)
    FAULTS[fault](redis_server)
    client = h.client_app(redis_url)
    first = client.send_task("locks.invoice", args=(7, "2026-12"), kwargs={"seconds": 5.0})
    assert first.get(timeout=60) == "sent 7:2026-12"
    # The result is stored just before the worker's post-run step: allow that step a moment.
    wait_for(lambda: _marker_written(redis_server, "invoice:7:2026-12"), 3, message="the idempotency marker")
    time.sleep(3.5)  # past the in-progress lock's ttl: only the marker can stop a second run
    assert client.send_task("locks.invoice", args=(7, "2026-12")).get(timeout=60) is None
    assert [r["outcome"] for r in h.runs(redis_client, "invoice")] == ["sent"]
    assert h.signals(redis_client, "idempotent_skipped")


def test_overlap_lock_release_sent_without_waiting_frees_the_lock_with_a_cold_script_cache(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    """``overlap_lock(on_conflict="skip")``, ttl 20 s: with an empty script cache the posted release
    gets ``NOSCRIPT``; it is run again before the task ends, so the lock is gone right after the run
    and the next call runs instead of being skipped for the rest of the ttl."""
    _locks_worker(processes, redis_url, redis_server, ttl=20.0)
    empty_script_cache(redis_server)
    client = h.client_app(redis_url)
    lock = redis.Redis.from_url(redis_server.url)
    try:
        assert client.send_task("locks.hold", args=("cold", 1.0)).get(timeout=60) == "finished"
        wait_for(lambda: not lock.exists("safe_time:lock:hold:cold"), 3, message="the lock to be released")
        assert client.send_task("locks.hold", args=("cold", 0.1)).get(timeout=60) == "finished"
    finally:
        lock.close()
    assert [r["outcome"] for r in h.runs(redis_client, "hold")] == ["finished", "finished"]
