"""Issue 17, no ghost keys: real workers on Redis and on RabbitMQ. A worker killed -9 mid-task frees
its key ``unique_ttl`` after the run started; a revoked or ``expires=``-expired queued copy frees it
when the worker drops the message; a hard time limit frees it from the worker's main process; a
message the broker lost blocks the key for its ttl and no longer."""

from __future__ import annotations

import time

import pytest
import redis

from tests.helpers import unique as u
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def test_kill_9_mid_task_frees_the_key_within_unique_ttl(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    ttl = 6.0
    app, tasks = u.client(broker_url, redis_url, sqlite_url, ttl=ttl)
    export = tasks["export"]
    try:
        worker = u.start_worker(processes, broker_url, redis_url, ttl=ttl)
        first = export.delay(1, seconds=60)
        [start] = wait_for(lambda: u.starts(redis_client, "export"), 60, message="the run to start")
        worker.kill()  # the whole process group: no finally, no signal handler runs
        killed = time.time()
        fields = u.key_fields(redis_client, "export:1")
        assert fields["task_id"] == first.id
        assert fields["state"] == "running"
        assert export.delay(1).id == first.id  # the holder cannot be told apart from a slow run yet
        u.wait_free(redis_client, "export:1", ttl + 5)
        freed = time.time()
        # counted from the start of the run (the key's ttl is refreshed there), not from the call
        assert freed - start["at"] >= ttl - 1.0
        assert freed - killed <= ttl + 2.0
        assert export.delay(1).id != first.id
    finally:
        app.close()


def test_revoked_and_expired_queued_copies_free_their_keys(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(broker_url, redis_url, sqlite_url)
    export = tasks["export"]
    try:
        u.start_worker(processes, broker_url, redis_url)
        revoked = export.apply_async((2,), countdown=3)
        expiring = export.apply_async((3,), countdown=3, expires=1)
        assert u.key_fields(redis_client, "export:2")["task_id"] == revoked.id
        revoked.revoke()
        u.wait_free(redis_client, "export:2", 30)
        u.wait_free(redis_client, "export:3", 30)
        assert revoked.state == "REVOKED"
        assert expiring.state == "REVOKED"
        assert u.starts(redis_client, "export") == []
        assert export.delay(2, seconds=0.1).get(timeout=30) == 2
    finally:
        app.close()


def test_hard_time_limit_frees_the_key(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(broker_url, redis_url, sqlite_url)
    limited = tasks["limited"]
    try:
        u.start_worker(processes, broker_url, redis_url)
        result = limited.delay(4)
        [start] = wait_for(lambda: u.starts(redis_client, "limited"), 60, message="the run to start")
        u.wait_free(redis_client, "limited:4", 20)
        assert time.time() - start["at"] < 10  # time_limit=1.5, not unique_ttl=30
        assert result.state == "FAILURE"
        assert limited.delay(4).id != result.id
    finally:
        app.close()


def test_a_message_the_broker_lost_blocks_the_key_for_its_ttl_only(
    broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    ttl = 3.0
    app, tasks = u.client(broker_url, redis_url, sqlite_url, ttl=ttl)
    export = tasks["export"]
    try:
        lost = export.delay(5)
        assert app.control.purge() >= 1  # the broker forgets the message; nobody tells the key
        assert export.delay(5).id == lost.id
        u.wait_free(redis_client, "export:5", ttl + 3)
        assert export.delay(5).id != lost.id
    finally:
        app.close()
