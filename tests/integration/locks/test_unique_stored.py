"""Issue 17, stored long delays: the unique key holds a stored row's task id, the row's delivery record
says honestly whether that holder is gone, and the key is also the row's idempotency key, so the store
refuses a second pending row even if Redis forgot the key. Real Redis, real SQLite store; the last test
runs the row through a real worker after a sweep."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_safe_time import SafeTask, cancel
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from tests.helpers import unique as u
from tests.helpers.delays import fresh_sql_store
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def test_stored_duplicates_share_one_row_and_cancel_frees_the_key(
    redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(redis_url, redis_url, sqlite_url, safe_time_delay_threshold=60)
    export = tasks["export"]
    try:
        first = export.apply_async((1,), countdown=7200)
        assert export.apply_async((1,), countdown=3600).id == first.id
        assert export.delay(1).id == first.id  # an immediate call waits for the stored one too
        rows = get_store(app).list()
        assert [r.id for r in rows] == [first.id]
        assert rows[0].idempotency_key == "unique:export:1"
        fields = u.key_fields(redis_client, "export:1")
        assert (fields["task_id"], fields["state"], fields["stored"]) == (first.id, "stored", "1")
        assert redis_client.pttl("safe_time:unique:export:1") / 1000 > 7200  # due time plus unique_ttl

        first.revoke()  # cancels the row, durably, and frees the key
        assert not redis_client.exists("safe_time:unique:export:1")
        second = export.apply_async((1,), countdown=3600)
        assert second.id != first.id
    finally:
        app.close()


def test_a_stored_holder_that_ended_is_seen_gone_through_its_row(
    redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(redis_url, redis_url, sqlite_url, safe_time_delay_threshold=60)
    export = tasks["export"]
    try:
        first = export.apply_async((2,), countdown=3600)
        # the row ends without anyone freeing the key (a cancel from another tool, the sweep expiring it)
        assert get_store(app).cancel(first.id)
        assert u.key_fields(redis_client, "export:2")["task_id"] == first.id
        second = export.apply_async((2,), countdown=3600)
        assert second.id != first.id
        assert u.key_fields(redis_client, "export:2")["task_id"] == second.id
    finally:
        app.close()


def test_the_store_refuses_a_second_pending_row_when_redis_forgot_the_key(
    redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(redis_url, redis_url, sqlite_url, safe_time_delay_threshold=60)
    export = tasks["export"]
    try:
        first = export.apply_async((3,), countdown=3600)
        redis_client.delete("safe_time:unique:export:3")  # a Redis reset
        again = export.apply_async((3,), countdown=3600)
        assert again.id == first.id
        assert len(get_store(app).list()) == 1
        assert u.key_fields(redis_client, "export:3")["task_id"] == first.id  # the key names the row again
    finally:
        app.close()


def test_explicit_idempotency_key_keeps_working_beside_unique(redis_url: str, sqlite_url: str) -> None:
    app, tasks = u.client(redis_url, redis_url, sqlite_url, safe_time_delay_threshold=60)
    export = tasks["export"]
    try:
        first = export.apply_async((4,), countdown=3600, idempotency_key="invoice-4")
        assert get_store(app).get(first.id).idempotency_key == "caller:unique.export:invoice-4"
        assert export.apply_async((4,), countdown=3600, idempotency_key="invoice-4").id == first.id
        assert cancel(first.id, app=app)
        assert export.apply_async((4,), countdown=3600, idempotency_key="invoice-4").id != first.id
    finally:
        app.close()


def test_a_caller_key_of_another_task_never_meets_a_stored_unique_row(
    redis_url: str, postgres_url: str, coordination: dict[str, Any]
) -> None:
    fresh_sql_store(postgres_url).close()
    app, tasks = u.client(redis_url, redis_url, postgres_url, safe_time_delay_threshold=60, coordination=coordination)
    export = tasks["export"]
    refund = app.task(base=SafeTask, shared=False, name="unique.refund")(_label)
    try:
        held = export.apply_async((5,), countdown=3600)
        # The unique key as another task's idempotency key: a row of its own, the unique row untouched.
        mine = refund.apply_async(("r",), countdown=3600, idempotency_key="export:5")
        assert mine.id != held.id
        # A caller's key pending first does not stand in for a unique call with that key either.
        refund.apply_async(("s",), countdown=3600, idempotency_key="export:6")
        second = export.apply_async((6,), countdown=3600)
        rows = {r.id: r.idempotency_key for r in get_store(app).list()}
        assert rows[held.id] == "unique:export:5"
        assert rows[second.id] == "unique:export:6"
        assert rows[mine.id] == "caller:unique.refund:export:5"
        assert len(rows) == 4
        with pytest.raises(ValueError, match="idempotency_key"):
            refund.apply_async(("t",), countdown=3600, idempotency_key="unique:export:5")
    finally:
        app.close()


def _label(label: str) -> str:
    return label


def test_a_stored_unique_task_runs_once_on_a_worker_and_frees_its_key(
    processes: ProcessManager, broker_url: str, redis_url: str, sqlite_url: str, redis_client: redis.Redis
) -> None:
    app, tasks = u.client(broker_url, redis_url, sqlite_url, safe_time_delay_threshold=1)
    export = tasks["export"]
    try:
        u.start_worker(processes, broker_url, redis_url, safe_time_delay_threshold=1)
        first = export.apply_async((5,), kwargs={"seconds": 1.0}, countdown=2)
        assert export.apply_async((5,), countdown=2).id == first.id
        assert get_store(app).get(first.id) is not None
        wait_for(lambda: sweep(app).sent, 30, interval=0.5, message="the sweep to publish the row")
        wait_for(lambda: u.starts(redis_client, "export"), 60, message="the stored run to start")
        assert u.key_fields(redis_client, "export:5")["state"] == "running"
        assert export.delay(5).id == first.id
        assert first.get(timeout=60) == 5
        u.wait_free(redis_client, "export:5", 10)
        assert get_store(app).get(first.id).status == "finished"
    finally:
        app.close()
