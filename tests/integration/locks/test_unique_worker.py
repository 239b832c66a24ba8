"""Issue 17: unique tasks with real workers, on Redis and on RabbitMQ. A second ``delay()`` hands back
the first copy while it is queued or running; the key is freed at the end whatever the outcome
(success, exception, ``Reject``), at the start with ``unique_until="executing"``, only by its ttl with
``"expired"``, and a task that retries itself keeps it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from celery_safe_time.exceptions import UniqueConflict
from tests.helpers import unique as u
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("broker_url", "coordination_conf"),
    [("redis", "redis"), ("amqp", "redis"), ("amqp", "postgres")],
    indirect=True,
)
def test_duplicate_delay_returns_the_first_copy_and_the_end_frees_the_key(
    processes: ProcessManager,
    broker_url: str,
    redis_url: str,
    sqlite_url: str,
    redis_client: redis.Redis,
    coordination_conf: dict[str, Any],
) -> None:
    """Also with the keys as PostgreSQL rows (RabbitMQ, no Redis setting)."""
    app, tasks = u.client(broker_url, redis_url, sqlite_url, coordination=coordination_conf)
    export = tasks["export"]
    try:
        first = export.delay(7, seconds=2.0)
        again = [export.delay(7), export.apply_async(kwargs={"user_id": 7}), export.apply_async((7,), countdown=1)]
        assert {r.id for r in again} == {first.id}
        assert u.key_state(app, "export:7") == {"task_id": first.id, "state": "queued"}
        other = export.delay(8)
        assert other.id != first.id

        u.start_worker(processes, broker_url, redis_url, coordination=coordination_conf)
        # user 8's run may start first (two pool processes): wait for user 7's own start
        wait_for(
            lambda: any(s["task_id"] == first.id for s in u.starts(redis_client, "export")),
            60,
            message="the first run to start",
        )
        # running: still handed back, and the key says so
        assert u.key_state(app, "export:7")["state"] == "running"
        assert export.delay(7).id == first.id
        assert first.get(timeout=60) == 7
        u.wait_key_free(app, "export:7", 10)
        assert other.get(timeout=30) == 8
        assert [s["task_id"] for s in u.starts(redis_client, "export")].count(first.id) == 1

        later = export.delay(7, seconds=0.1)
        assert later.id != first.id
        assert later.get(timeout=30) == 7
        u.wait_key_free(app, "export:7", 10)
    finally:
        app.close()


def test_failure_and_reject_free_the_key(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(broker_url, redis_url, sqlite_url)
    try:
        u.start_worker(processes, broker_url, redis_url)
        failed = tasks["failing"].delay(1)
        with pytest.raises(ValueError, match="failing 1"):
            failed.get(timeout=60)
        u.wait_free(redis_client, "failing:1", 10)
        rejected = tasks["rejecting"].delay(1)
        wait_for(lambda: u.starts(redis_client, "rejecting"), 60, message="the rejecting run")
        u.wait_free(redis_client, "rejecting:1", 10)
        assert tasks["rejecting"].delay(1).id != rejected.id
    finally:
        app.close()


def test_retry_keeps_the_key_and_never_conflicts_with_itself(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(broker_url, redis_url, sqlite_url)
    flaky = tasks["flaky"]
    try:
        u.start_worker(processes, broker_url, redis_url)
        result = flaky.delay(3, fails=2, countdown=1.5)
        wait_for(lambda: u.starts(redis_client, "flaky"), 60, message="the first attempt")
        # between attempts the retried task still holds the key: a new call gets it back
        wait_for(lambda: u.key_fields(redis_client, "flaky:3").get("state") == "retrying", 30, message="retrying")
        assert flaky.delay(3).id == result.id
        assert result.get(timeout=60) == 2
        attempts = u.starts(redis_client, "flaky")
        assert [a["retries"] for a in attempts] == [0, 1, 2]
        assert {a["task_id"] for a in attempts} == {result.id}
        u.wait_free(redis_client, "flaky:3", 10)
    finally:
        app.close()


def test_until_executing_frees_at_start_and_expired_only_by_ttl(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    ttl = 6.0
    app, tasks = u.client(broker_url, redis_url, sqlite_url, ttl=ttl)
    try:
        u.start_worker(processes, broker_url, redis_url, ttl=ttl)
        first = tasks["early"].delay(1, seconds=3.0)
        wait_for(lambda: u.starts(redis_client, "early"), 60, message="the early run to start")
        u.wait_free(redis_client, "early:1", 5)
        second = tasks["early"].delay(1, seconds=0.1)  # queued while the first still runs
        assert second.id != first.id
        assert not first.ready()

        ran = tasks["window"].delay(1)
        assert ran.get(timeout=60) == 1
        taken = time.time()
        assert tasks["window"].delay(1).id == ran.id  # it ran, the key stays for its ttl
        assert u.key_fields(redis_client, "window:1")["task_id"] == ran.id
        u.wait_free(redis_client, "window:1", ttl + 5)
        assert time.time() - taken > ttl - 2
        assert tasks["window"].delay(1).id != ran.id
    finally:
        app.close()


def test_unique_until_executing_with_overlap_lock_is_until_and_while_executing(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(broker_url, redis_url, sqlite_url)
    guarded = tasks["guarded"]
    try:
        first = guarded.delay(1, seconds=3.0)
        assert guarded.delay(1).id == first.id  # queued: one copy
        u.start_worker(processes, broker_url, redis_url, concurrency=4)
        wait_for(lambda: u.starts(redis_client, "guarded"), 60, message="the first run to start")
        u.wait_free(redis_client, "guarded:1", 5)  # started: the unique key is free
        second = guarded.delay(1, seconds=0.2)  # queued while the first runs: a copy of its own
        assert second.id != first.id
        assert guarded.delay(1).id == second.id  # and only one such copy
        assert first.get(timeout=60) == 1
        assert second.get(timeout=60) == 1
        runs = {r["task_id"]: r["at"] for r in u.runs(redis_client, "guarded")}
        started = {s["task_id"]: s["at"] for s in u.starts(redis_client, "guarded")}
        assert set(started) == {first.id, second.id}  # each ran once
        # never two at once: the copy queued during the first run started after it ended
        assert started[second.id] >= runs[first.id]
    finally:
        app.close()


def test_on_conflict_raise_names_the_key_and_the_holder(
    redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(redis_url, redis_url, sqlite_url)
    try:
        first = tasks["strict"].delay(9)
        with pytest.raises(UniqueConflict) as caught:
            tasks["strict"].delay(user_id=9)
        assert caught.value.key == "strict:9"
        assert caught.value.holder == first.id
        assert caught.value.state == "queued"
        assert first.id in str(caught.value)
        assert "strict:9" in str(caught.value)
    finally:
        app.close()
