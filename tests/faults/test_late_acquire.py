"""Issue 38 part 4, leases dated from the send: an acquire whose answer comes after the lease it
granted has ended is not held. A real TCP proxy holds the acquire's reply of one worker for 8 s (under
the 10 s io timeout) while the lease is 6 s; real prefork workers; Redis and PostgreSQL coordination."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from celery_safe_time.coordination import dispose_engines
from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers import locks as h
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration

#: (lease, reply delay) per backend: the delay under its io timeout (Redis: 5 s socket timeout;
#: PostgreSQL: the 10 s safe_time_coordination_io_timeout), the lease shorter than the delay.
TIMINGS = {"redis": (3.0, 4.0), "postgres": (6.0, 8.0)}
#: Every statement or script call of ``locks.pair``'s slots names the slot's lock
#: (``<prefix>lock:slot:pair:k#<n>``); the acquire comes first.
NEEDLE = b"slot:pair:"


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = running = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best


LateConf = tuple[TcpProxy, dict[str, Any], dict[str, Any], tuple[float, float]]


@pytest.fixture(params=sorted(TIMINGS))
def late_conf(request: pytest.FixtureRequest, redis_url: str) -> Iterator[LateConf]:
    """(the proxy, the late worker's coordination settings through it, the other worker's settings,
    the lease and reply delay)."""
    timings = TIMINGS[request.param]
    if request.param == "redis":
        parts = urlsplit(redis_url)
        proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
        proxied = urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path, parts.query, ""))
        yield proxy, {"safe_time_redis_url": proxied}, {}, timings
        proxy.close()
        return
    url: str = request.getfixturevalue("postgres_coordination_url")
    proxy, proxied = proxy_for(url)
    mode = {"safe_time_coordination_locks": "lease"}
    yield proxy, {"safe_time_coordination_url": proxied, **mode}, {"safe_time_coordination_url": url, **mode}, timings
    proxy.close()
    dispose_engines()


# In make soak, not make test: in a whole fresh-clone make test the [redis] case once found the late
# worker's task run undelayed (4.0 s), so the proxy held back some other reply matching the slot's
# name, not the acquire's; until its trigger picks the acquire alone it runs where it is watched.
@pytest.mark.slow
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
    proxy, late, other, (ttl, delay) = late_conf
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
        proxy.delay_reply(NEEDLE, delay)
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
    assert most_at_once(intervals) <= 2, sorted(intervals)
    assert "was answered" in late_worker.log(), "the late answer was seen as late, not run in"
