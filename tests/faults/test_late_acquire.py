"""Issue 38 part 4, leases dated from the send: an acquire whose answer comes after the lease it
granted has ended is not held. A real TCP proxy holds the acquire's reply of one worker for 8 s (under
the 10 s io timeout) while the lease is 6 s; real prefork workers; Redis and PostgreSQL coordination."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from celery_safe_time.coordination import dispose_engines
from celery_safe_time.locks.backends.postgres_sql import QUERIES
from celery_safe_time.locks.backends.redis import SCRIPT_PACKAGE
from celery_safe_time.redis_client import load_script
from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers import locks as h
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration

#: (lease, reply delay) per backend: the delay under its io timeout (Redis: 5 s socket timeout;
#: PostgreSQL: the 10 s safe_time_coordination_io_timeout), the lease shorter than the delay.
TIMINGS = {"redis": (3.0, 4.0), "postgres": (6.0, 8.0)}
#: What only a lock acquire sends, per backend: on Redis the ``EVALSHA`` of the acquire script (the
#: lean path and redis-py's send the same bytes; a renewal, a release or a "who holds this slot" read
#: is another command or script), on PostgreSQL the acquire statement (sent as text each time: the
#: coordination engine prepares no statements).
_ACQUIRE_SHA = hashlib.sha1(load_script(SCRIPT_PACKAGE, "acquire").encode()).hexdigest().encode()
NEEDLES = {
    "redis": b"$7\r\nEVALSHA\r\n$40\r\n" + _ACQUIRE_SHA,
    "postgres": QUERIES["acquire"].encode()[:48],
}
#: A reply not to hold: ``NOSCRIPT`` (another test flushed the shared Redis's scripts); the worker
#: loads the script and sends the acquire again, and that reply is held.
PASSED = {"redis": b"-NOSCRIPT", "postgres": None}


LateConf = tuple[TcpProxy, dict[str, Any], dict[str, Any], tuple[float, float], str]


@pytest.fixture(params=sorted(TIMINGS))
def late_conf(request: pytest.FixtureRequest, redis_url: str) -> Iterator[LateConf]:
    """(the proxy, the late worker's coordination settings through it, the other worker's settings,
    the lease and reply delay, the backend)."""
    timings = TIMINGS[request.param]
    if request.param == "redis":
        parts = urlsplit(redis_url)
        proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
        proxied = urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path, parts.query, ""))
        yield proxy, {"safe_time_redis_url": proxied}, {}, timings, request.param
        proxy.close()
        return
    url: str = request.getfixturevalue("postgres_coordination_url")
    proxy, proxied = proxy_for(url)
    mode = {"safe_time_coordination_locks": "lease"}
    late = {"safe_time_coordination_url": proxied, **mode}
    yield proxy, late, {"safe_time_coordination_url": url, **mode}, timings, request.param
    proxy.close()
    dispose_engines()


def test_a_slot_whose_acquire_was_answered_after_its_lease_ended_is_not_run_in(
    processes: ProcessManager,
    redis_url: str,
    redis_client: redis.Redis,
    late_conf: LateConf,
) -> None:
    """``concurrency_limit(limit=2, ttl=6)``; worker A's acquire reply arrives 8 s late (on Redis: 3 s
    and 4 s, under its 5 s socket timeout). Before: A
    dated its slot from the reply, although the server had let it expire at 6 s and another call had
    taken it: 3 ran at once. Now A counts the lease from the send, finds the answer too late, gives
    the slot back and waits its turn: never more than 2 at once, and every call runs once."""
    proxy, late, other, (ttl, delay), backend = late_conf
    lock_env = {"SAFE_TIME_TEST_LOCK_TTL": str(ttl), "SAFE_TIME_TEST_RETRY_AFTER": "0.5"}

    def worker(name: str, conf: dict[str, Any], *extra: str) -> CeleryProcess:
        env = {**h.broker_env(redis_url, redis_url, coordination=conf or None), **lock_env}
        if "safe_time_redis_url" in conf:  # Redis coordination through the proxy: the override wins
            env = {**h.broker_env(redis_url, redis_url, **conf), **lock_env}
        proc = processes.worker(h.APP, *extra, name=name, concurrency=2, env=env)
        proc.wait_for_log(r"ready\.", timeout=90)
        return proc

    late_worker = worker("late", late, "-Q", "late")
    worker("other", other)
    client = h.client_app(redis_url)
    try:
        proxy.delay_reply(NEEDLES[backend], delay, unless_reply=PASSED[backend])
        late_call = client.send_task("locks.pair", args=("k", 4.0), queue="late")
        wait_for(lambda: proxy.replies_delayed == 1, 30, message="the late worker's acquire to be sent")
        # The late worker's slot is taken on the server; the other worker's two calls take the other
        # slot, then (once the held slot's lease ended) that one too.
        others = [client.send_task("locks.pair", args=("k", 10.0)) for _ in range(2)]
        for result in [late_call, *others]:
            result.get(timeout=120)
    finally:
        client.close()

    runs = h.runs(redis_client, "pair")
    assert sorted(r["task_id"] for r in runs) == sorted([late_call.id, *(r.id for r in others)]), runs
    intervals = [(float(r["started"]), float(r["finished"])) for r in runs]
    assert h.most_at_once(intervals) <= 2, sorted(intervals)
    assert "was answered" in late_worker.log(), "the late answer was seen as late, not run in"
