"""PostgreSQL coordination faults under Safe Beat: the database unreachable (a TCP proxy in front of
the shared server is cut: the server itself is never restarted, other sessions share it), and the
connection lost during a guarded dispatch (the proxy drops it once the server replied, or before it
saw the statement).

Fail closed: nothing fires while the database is gone; afterwards one leader resumes, no slot twice,
and the epoch goes on from where it was (it lives in a row: it never restarts). A lost dispatch
reply neither misses the slot nor publishes it twice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_safe_time.beat.backends import SlotWrite, beat_backend
from celery_safe_time.beat.backends.postgres import PostgresBeatBackend, PostgresLease
from celery_safe_time.config import get_config
from celery_safe_time.coordination import dispose_engines
from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers.beat import BEAT_APP, beat_env, coordination_settings, duplicates, holder_pid, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
SCHEDULE = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}


@pytest.fixture
def proxied(postgres_url: str) -> Iterator[tuple[TcpProxy, dict[str, Any]]]:
    proxy, url = proxy_for(postgres_url)
    yield proxy, coordination_settings(url)
    proxy.close()
    dispose_engines()  # the pool's connections went through the proxy


def _epochs_after(client: redis.Redis, since: float, until: float = float("inf")) -> set[int]:
    return {int(r["headers"]["safe_time_epoch"]) for r in runs(client) if since < float(r["started"]) < until}


def test_database_unreachable_nothing_fires_then_one_leader_resumes(
    processes: ProcessManager, redis_client: redis.Redis, proxied: tuple[TcpProxy, dict[str, Any]]
) -> None:
    proxy, coordination = proxied
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(2)]
    wait_for(lambda: holder_pid(redis_client, coordination), 30, message="a leader")
    wait_for(lambda: len(runs(redis_client)) >= 2, 30, message="runs")
    # a beat still starting when the database goes is refused at startup (it exits, by design): on a
    # loaded machine one can still be importing when the other already fires
    # (the log line "beat: safe-time -> ...", not the banner printed before the checks)
    wait_for(lambda: all("beat: safe-time -> " in b.log() for b in beats), 60, message="both beats past their startup")
    before = _epochs_after(redis_client, 0.0)
    proxy.cut()
    cut_at = time.time()
    time.sleep(LEASE + 2)
    # fail closed: no beat can check the lease, so none publishes (2 s for the worker's backlog)
    assert [r for r in runs(redis_client) if float(r["started"]) > cut_at + 2] == []
    proxy.restore()
    came_back = time.time()
    wait_for(lambda: any(float(r["started"]) > came_back for r in runs(redis_client)), 60, message="firing resumes")
    time.sleep(LEASE + 2)
    for beat in beats:
        assert beat.alive()
    assert any("PostgreSQL" in b.log() and "unreachable" in b.log() for b in beats)
    # runs from here on may come from a hand-over: the leader stopped first releases the lease
    # and the other beat, still running, takes it (a new epoch, as it should)
    stopping = time.time()
    for beat in beats:
        beat.terminate()
    time.sleep(2)
    assert duplicates(redis_client) == {}
    after = _epochs_after(redis_client, came_back + LEASE, stopping)
    assert len(after) == 1, "more than one leader after the outage"
    assert min(after) >= max(before), "the epoch went backwards"


#: What the guarded dispatch statements send (the table creation names the table too, not this).
DISPATCH = b"INSERT INTO safe_time_beat_fired"


def _leader(make_app: Any, coordination: dict[str, Any]) -> tuple[PostgresBeatBackend, PostgresLease, int]:
    backend = beat_backend(get_config(make_app(safe_time_beat_lease=LEASE, **coordination)))
    assert isinstance(backend, PostgresBeatBackend)
    backend.ensure_tables()
    lease = backend.make_lease()
    epoch = lease.acquire(backend.clock.time())
    assert epoch is not None
    return backend, lease, epoch


@pytest.mark.parametrize("server_gets_it", [True, False], ids=["reply-lost", "never-arrived"])
def test_a_dispatch_whose_connection_breaks_is_asked_again_and_publishes_once(
    make_app: Any, proxied: tuple[TcpProxy, dict[str, Any]], server_gets_it: bool
) -> None:
    """Issue 18: the statement committed and only its reply was lost (the slot's row is ours: publish),
    or it never reached the server (no row: still the leader, dispatch again). Both answer "publish"
    once; the next call for the same slot answers "already fired"."""
    proxy, coordination = proxied
    backend, lease, epoch = _leader(make_app, coordination)
    writes = [SlotWrite("e", '{"last": 100}', 110.0, 100.0), SlotWrite("adv", '{"last": 5}', 15.0)]
    proxy.lose_reply(DISPATCH, server_gets_it=server_gets_it)
    assert lease.write_slots(epoch, writes) == [1, 1]
    assert proxy.replies_lost == 1
    assert lease.write_slots(epoch, writes) == [0, 1]  # a later call: already fired
    assert backend.read_states(["e", "adv"]) == (['{"last": 100}', '{"last": 5}'], [110.0, 15.0])
    # the same for the dispatch check alone (SafeDatabaseScheduler's)
    proxy.lose_reply(DISPATCH, server_gets_it=server_gets_it)
    assert lease.dispatch_slot(epoch, "db", 100.0) == 1
    assert proxy.replies_lost == 2
    assert lease.dispatch_slot(epoch, "db", 100.0) == 0
    assert backend.slot_fired("db", 100.0)


def test_a_lost_reply_for_a_slot_fired_before_still_answers_already_fired(
    make_app: Any, proxied: tuple[TcpProxy, dict[str, Any]]
) -> None:
    """The row found on the retry is another call's: not ours to publish."""
    proxy, coordination = proxied
    _, lease, epoch = _leader(make_app, coordination)
    assert lease.dispatch_slot(epoch, "e", 100.0) == 1
    proxy.lose_reply(DISPATCH)
    assert lease.write_slots(epoch, [SlotWrite("e", "{}", 120.0, 100.0), SlotWrite("e", "{}", 130.0, 120.0)]) == [0, 1]
    proxy.lose_reply(DISPATCH)
    assert lease.dispatch_slot(epoch, "e", 120.0) == 0
    assert proxy.replies_lost == 2


def test_a_lost_reply_whose_statement_committed_publishes_even_if_the_lease_is_gone_since(
    make_app: Any, proxied: tuple[TcpProxy, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt wrote the slot under the lease; the lease ends before the retry (a take-over
    in between): the slot is still ours to publish (nobody else may), and a new call is refused."""
    proxy, coordination = proxied
    backend, lease, epoch = _leader(make_app, coordination)
    original = backend.autocommit
    calls: list[int] = []

    def release_before_the_retry() -> Any:
        calls.append(1)
        if len(calls) == 2:  # the retry's connection: the lease ends first
            with original() as conn:
                conn.exec_driver_sql(
                    "UPDATE safe_time_beat_lease SET expires_at = clock_timestamp() WHERE ns = %(ns)s",
                    {"ns": backend.ns},
                )
        return original()

    monkeypatch.setattr(backend, "autocommit", release_before_the_retry)
    proxy.lose_reply(DISPATCH)
    assert lease.write_slots(epoch, [SlotWrite("e", "{}", 110.0, 100.0)]) == [1]
    assert len(calls) == 2
    monkeypatch.undo()
    assert lease.write_slots(epoch, [SlotWrite("e", "{}", 120.0, 110.0)]) == [-1]


def test_a_due_read_on_a_pooled_connection_that_broke_reads_again_and_the_leader_stays(
    make_app: Any, proxied: tuple[TcpProxy, dict[str, Any]]
) -> None:
    """The idle tick's read has no pre-ping (it was a second round trip per tick): a pooled connection
    the database dropped meanwhile (here: every connection, as a restart does) is found by the read
    itself, replaced, and the read asked again; the tick answers as if nothing happened."""
    proxy, coordination = proxied
    backend, lease, epoch = _leader(make_app, coordination)
    assert lease.write_slots(epoch, [SlotWrite("e", '{"last": 100}', 110.0, 100.0)]) == [1]
    first = backend.read_due(200.0, 10)
    assert first.due == [("e", 110.0)]
    assert backend.head() == [("e", 110.0)]
    _drop_connections(proxy)  # as a restart does; the server itself never restarts (it is shared)
    again = backend.read_due(200.0, 10)
    assert (again.due, again.due_count, again.state_count) == (first.due, first.due_count, first.state_count)
    _drop_connections(proxy)
    assert backend.head() == [("e", 110.0)]
    assert lease.renew()  # still the leader: nothing stepped down


def _drop_connections(proxy: TcpProxy) -> None:
    proxy.cut()

    def listening() -> bool:
        try:
            proxy.restore()  # the listener's port is free once the accept thread let it go
        except OSError:
            return False
        return True

    wait_for(listening, 10, interval=0.05, message="the proxy listening again")
