"""Stacked gates under the faults a process cannot show (issue 38): real prefork workers, the broker
on Redis with a 4 s visibility timeout, the locks on a coordination backend behind a proxy: a
redis-server of the test's own, or the session's PostgreSQL database (``safe_time_coordination_url``,
lease rows).

The cases are generated: every ordered pair of ``tests/apps/stack_gates.STACK_GATES`` with a bound
on how many run at once is a candidate, and each backend's faults take pairs spread over them, each
backend other pairs (the in-process matrix, tests/unit/locks/test_composition.py, runs every pair
under the faults it can simulate). Three calls of one key, each a 2 s body (4 s under a restart, a
stall or a cut):

- ``worker_killed``: kill -9 of the worker while a body runs; a second worker gets the unacknowledged
  message once the broker restores it, and runs it once the dead holder's lease has run out.
- ``redis_restart``: the locks' Redis restarts without persistence while a body runs (every key, the
  script cache and every connection gone).
- ``stalled_connection``: every open connection to the locks' server stops forwarding for 6 s.
- ``connection_cut`` (PostgreSQL): every connection to the database drops and new ones are refused
  for 6 s (the database is unreachable; the rows stay).

Whatever the fault: a call's body completes at most once (exactly once after a kill: acks_late runs
it again); a call that does not complete was told its lock was lost (its run ends as failed, as Celery
ends a failed acks_late task: acknowledged, not run again), and a call told so that did complete was
still running when the fault began (its body returned before the loss was seen: the lock is checked
once more after the body, and the run fails, its work unprotected to the end); the bodies that complete
never exceed the pair's bound at once; and one ttl after the last call nothing is held.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlunsplit

import pytest
import redis
import sqlalchemy as sa

from celery_safe_time import constants as C
from tests.apps.stack_gates import STACK_GATES
from tests.faults.proxy import TcpProxy, proxy_for
from tests.faults.redis_faults import restart_cold
from tests.helpers import locks as h
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration

TTL = 3.0
CALLS = 3
#: How long a stall or a cut lasts: past the lease, so the holder's renewals fail or go unanswered.
OUTAGE = 6.0
#: Each body's length: past the lease under a stall or a cut, so the cut-off holder's renewals
#: matter; under a restart long enough that a renewal (every ttl/3) falls after the restart inside
#: the body, however late the restart comes on a loaded machine (a body ending before it would
#: complete unaware).
BODY = {"worker_killed": 2.0, "redis_restart": 4.0, "stalled_connection": 4.0, "connection_cut": 4.0}


def bound(pair: tuple[str, str]) -> int | None:
    """How many calls of one key the pair lets run at once (the tighter gate's bound)."""
    limits = [limit for limit in (STACK_GATES[pair[0]][0], STACK_GATES[pair[1]][0]) if limit is not None]
    return min(limits) if limits else None


#: The faults each coordination backend is put through: PostgreSQL keeps its rows through an outage
#: (no cold restart); a cut there is what a restart or a failover looks like to the workers.
FAULTS = {
    "redis": ["worker_killed", "redis_restart", "stalled_connection"],
    "postgres": ["worker_killed", "stalled_connection", "connection_cut"],
}
BOUNDED = [pair for pair in itertools.permutations(STACK_GATES, 2) if bound(pair) is not None]


def _cases() -> list[tuple[str, str, tuple[str, str]]]:
    """One pair per fault, spread over the bounded pairs (a new gate shifts which ones); each further
    backend starts its walk halfway between the previous one's steps, so the backends take other pairs."""
    cases = []
    for b, (backend, faults) in enumerate(FAULTS.items()):
        step = len(BOUNDED) // len(faults)
        offset = b * ((step + 1) // 2)
        cases += [(backend, f, BOUNDED[(i * step + offset) % len(BOUNDED)]) for i, f in enumerate(faults)]
    return cases


CASES = _cases()


class LocksPath:
    """Where the workers' locks are: the URL through a proxy, the proxy, and what is held there."""

    def __init__(self, proxy: TcpProxy, coordination: dict[str, str], held: Callable[[], list[str]]) -> None:
        self.proxy = proxy
        self.coordination = coordination
        self.held = held


@pytest.fixture
def locks_path(request: pytest.FixtureRequest, backend: str) -> Iterator[LocksPath]:
    """A proxy in front of the backend's server, the workers' settings through it, and a look at
    the locks still held (read past the proxy)."""
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        proxy = TcpProxy("127.0.0.1", server.port)
        client = redis.Redis.from_url(server.url)
        url = urlunsplit(("redis", f"127.0.0.1:{proxy.port}", "/0", "", ""))
        yield LocksPath(
            proxy,
            {"safe_time_redis_url": url},
            lambda: [k.decode() for k in client.scan_iter("safe_time:lock:*")],
        )
        client.close()
        proxy.close()
        return
    # Lock rows of earlier tests deleted: this session's database is this test's alone for now.
    database: str = request.getfixturevalue("postgres_coordination_url")
    proxy, url = proxy_for(database)
    engine = sa.create_engine(database, poolclass=sa.pool.NullPool)
    live = sa.text(f"SELECT name FROM {C.PG_LOCK_TABLE} WHERE expires_at > now()")

    def held() -> list[str]:
        with engine.connect() as conn:
            return [str(name) for name in conn.execute(live).scalars()]

    yield LocksPath(proxy, {"safe_time_coordination_url": url}, held)
    engine.dispose()
    proxy.close()


@pytest.mark.parametrize(("backend", "fault", "pair"), CASES, ids=[f"{b}-{f}-{p[0]}.{p[1]}" for b, f, p in CASES])
def test_stacked_gates_keep_their_promises_through_a_fault(
    request: pytest.FixtureRequest,
    processes: ProcessManager,
    redis_url: str,
    redis_client: redis.Redis,
    locks_path: LocksPath,
    backend: str,
    fault: str,
    pair: tuple[str, str],
) -> None:
    proxy = locks_path.proxy
    env = h.broker_env(redis_url, redis_url, visibility_timeout=4, coordination=locks_path.coordination)
    first = h.start_worker(processes, name="first", concurrency=3, ttl=TTL, retry_after=0.5, env=env)
    client = h.client_app(redis_url)
    task = f"locks.stack.{pair[0]}.{pair[1]}"
    try:
        results = [client.send_task(task, args=("k", n, BODY[fault])) for n in range(CALLS)]
        wait_for(lambda: redis_client.llen(h.STARTS) >= 1, 60, message="a body to start")
        killed_at = None
        fault_at = time.time()
        if fault == "worker_killed":
            first.kill()
            killed_at = time.time()
            h.start_worker(processes, name="second", concurrency=3, ttl=TTL, retry_after=0.5, env=env)
        elif fault == "redis_restart":
            restart_cold(request.getfixturevalue("redis_server"))
        elif fault == "stalled_connection":
            assert proxy.stall() >= 1  # the running body's renewals go out on one of them
            time.sleep(OUTAGE)
            proxy.resume()
        else:
            proxy.cut()
            time.sleep(OUTAGE)
            proxy.restore()
        outcomes = _outcomes(results)
    finally:
        client.close()

    runs = h.runs(redis_client, "stack")
    completed = {r["task_id"]: sum(1 for x in runs if x["task_id"] == r["task_id"]) for r in runs}
    assert all(count == 1 for count in completed.values()), runs
    for result in results:
        if fault == "worker_killed":
            assert outcomes[result.id] == "SUCCESS", (outcomes, runs)
            assert completed.get(result.id) == 1, runs
        elif outcomes[result.id] != "SUCCESS":
            assert "lost" in outcomes[result.id].lower(), (outcomes, runs)
            ran = [r for r in runs if r["task_id"] == result.id]
            assert all(float(r["finished"]) >= fault_at for r in ran), (fault_at, runs)
    # The bodies that completed, and a killed one until the kill, never beyond the pair's bound.
    intervals = [(float(r["started"]), float(r["finished"])) for r in runs]
    if killed_at is not None:
        starts = [json.loads(raw) for raw in redis_client.lrange(h.STARTS, 0, -1)]
        ended = {(r["task_id"], r["pid"]) for r in runs}
        cut = [(s["at"], killed_at) for s in starts if (s["task_id"], s["pid"]) not in ended]
        assert cut, "the kill cut no body short"
        intervals += cut
    limit = bound(pair)
    assert limit is not None
    assert h.most_at_once(intervals) <= limit, sorted(intervals)
    # Nothing held one ttl after the last call ended.
    wait_for(lambda: not locks_path.held(), TTL + 2, message="every lock to be free")


def _outcomes(results: list[Any]) -> dict[str, str]:
    """Each call's final state (waits for all of them)."""
    outcomes: dict[str, str] = {}
    for result in results:
        try:
            result.get(timeout=90)
        except Exception as exc:  # a run told its lock was lost fails; the assertions look at why
            outcomes[result.id] = f"{type(exc).__name__}: {exc}"
            continue
        outcomes[result.id] = "SUCCESS"
    return outcomes
