"""Locks under the faults production brings: an empty script cache, a connection the server closed
while the body ran. A release or an idempotency commit sent without waiting is settled before the
delivery ends, so it is never lost. Real workers, a redis-server of the test's own for the locks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.faults.proxy import TcpProxy, proxy_for
from tests.faults.redis_faults import close_idle_connections, empty_script_cache, restart_cold
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


def test_idempotent_key_survives_a_cold_redis_restart_while_its_body_runs(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    """Redis restarts (no persistence: keys, script cache and every connection gone) while a 5 s
    ``@idempotent`` body runs. The commit meets a closed connection and an empty script cache; it is
    sent again before the task ends, and writes the marker (the lock it would release is gone with
    the restart), so a later call is skipped: one run. (ttl 30 s: no renewal falls in the body; one
    would find the lock gone and end the run with ``LockLost``, a run that records nothing.)"""
    _locks_worker(processes, redis_url, redis_server, ttl=30.0)
    client = h.client_app(redis_url)
    first = client.send_task("locks.invoice", args=(8, "2026-12"), kwargs={"seconds": 5.0})
    time.sleep(2.0)  # the worker took the lock and sleeps in the body
    restart_cold(redis_server)
    assert first.get(timeout=60) == "sent 8:2026-12"
    wait_for(lambda: _marker_written(redis_server, "invoice:8:2026-12"), 3, message="the idempotency marker")
    assert client.send_task("locks.invoice", args=(8, "2026-12")).get(timeout=60) is None
    assert [r["outcome"] for r in h.runs(redis_client, "invoice")] == ["sent"]


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


@pytest.fixture(params=["redis", "postgres", "postgres-session"])
def stalling_coordination(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> Iterator[tuple[TcpProxy, dict[str, Any]]]:
    """A proxy in front of the locks' server (a redis-server of the test's own, or the session's
    PostgreSQL database) and the app settings that reach it through the proxy."""
    if request.param == "redis":
        proxy = TcpProxy("127.0.0.1", redis_server.port)
        conf: dict[str, Any] = {"safe_time_redis_url": f"redis://127.0.0.1:{proxy.port}/0"}
    else:
        proxy, url = proxy_for(request.getfixturevalue("postgres_coordination_url"))
        mode = "session" if request.param == "postgres-session" else "lease"
        conf = {"safe_time_coordination_url": url, "safe_time_coordination_locks": mode}
    yield proxy, conf
    proxy.close()


def test_a_holder_whose_connection_stalls_sees_lock_lost_within_its_ttl_and_returns(
    processes: ProcessManager,
    redis_url: str,
    redis_client: redis.Redis,
    stalling_coordination: tuple[TcpProxy, dict[str, Any]],
) -> None:
    """The proxy in front of the locks' server stops forwarding on every open connection while a
        ``ttl=3`` lock is held (new connections still pass). The renewal hangs; the holder is told
        ``LockLost`` before its lease ends and its task returns (the release finds a live connection once
        the hung one's deadline passes), and the next run of the key starts only after it: never two at
        once. Before, on PostgreSQL the renewal waited forever, the task never returned, and a second
        holder took the expired lock beside it. The key's next run starts once the path heals (a session
    advisory lock is held by its server session until the server sees the connection close)."""
    proxy, conf = stalling_coordination
    ttl = 3.0
    env = h.broker_env(redis_url, redis_url, coordination=conf)
    h.start_worker(processes, ttl=ttl, concurrency=2, env=env)
    client = h.client_app(redis_url)
    first = client.send_task("locks.hold", args=("stalled", 60.0))
    wait_for(lambda: redis_client.get(f"test:locks:started:{first.id}"), 60, message="the first run to start")
    stalled_at = time.time()
    proxy.stall()
    with pytest.raises(Exception, match=r"lost"):
        first.get(timeout=60, propagate=True)
    returned_at = time.time()
    [lost] = h.signals(redis_client, "overlap_lock_lost")
    assert lost["at"] - stalled_at < ttl, "told after the lease had ended"
    # The task returns once told; its release may be sent without waiting (then settled after the
    # task, past the stalled connection's deadline: PostgreSQL's 10 s io timeout, Redis' 5 s socket
    # timeout) or waited for on a new connection.
    assert returned_at - stalled_at < ttl + 10.0 + 8.0
    # The path heals: a session lock's server session, kept alive by the stalled proxy, now ends.
    proxy.resume()
    # The holder is told before its lease ends, so the lease may outlast the task's result by part of
    # a ttl (and a renewal the proxy held, delivered now, may extend it by one ttl before the release
    # deletes it): a call sent meanwhile is rightly skipped. One ttl after the heal no lease is left.
    time.sleep(ttl)
    second = client.send_task("locks.hold", args=("stalled", 0.2))
    assert second.get(timeout=60) == "finished"
    runs = h.runs(redis_client, "hold")
    assert [r["outcome"] for r in runs] == ["lost", "finished"]
    assert h.overlaps([(r["started"], r["finished"]) for r in runs]) == []
