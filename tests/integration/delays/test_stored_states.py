"""Stored calls report Celery's states and ids: real workers and beat (the sweep), Redis as broker and
result backend, the SQLite store; the broker-expired row on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, states
from celery.exceptions import ChordError, TaskRevokedError

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import DELAYS_APP, fresh_sql_store, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

#: Threshold 1.5 s (half the visibility timeout); the sweep every second.
CONF: dict[str, Any] = {"broker_transport_options": {"visibility_timeout": 3}, "safe_time_sweep_interval": 1}


def _app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    app = make_app("stored-states", **{**CONF, **conf})
    install(app)
    define_tasks(app)
    return app


def _start_cluster(processes: ProcessManager) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps(CONF)}
    worker = processes.worker(DELAYS_APP, name="w0", env=env)
    processes.beat(DELAYS_APP, name="beat", env=env, scheduler="celery.beat:PersistentScheduler")
    worker.wait_for_log(r"ready\.", timeout=90)


def _run_of(client: redis.Redis, label: str) -> dict[str, Any]:
    found = wait_for(
        lambda: next((r for r in runs(client) if r["label"] == label), None), timeout=60, message=f"{label} ran"
    )
    assert isinstance(found, dict)
    return found


def test_an_expired_stored_call_is_revoked_and_its_chord_fails_as_celerys(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    _start_cluster(processes)
    app = _app(make_app)
    record, add = app.tasks["tests.delays.record"], app.tasks["tests.delays.add"]

    expired = record.apply_async(("expired",), countdown=4, expires=2)
    header = [add.s(1, 1).set(countdown=4, expires=2), add.s(2, 2)]
    chorded = chord(header)(record.s())
    assert get_store(app).get(expired.id) is not None  # stored, not sent

    # Plain Celery: TaskRevokedError('expired'), and the chord's callback fails naming the dependency.
    with pytest.raises(TaskRevokedError, match="expired"):
        expired.get(timeout=60)
    assert expired.state == states.REVOKED
    with pytest.raises(TaskRevokedError, match="expired"):
        chorded.get(timeout=60)  # the header's error first, as Celery's result reports it
    callback = app.AsyncResult(chorded.id)  # the callback's own state, without its parent
    with pytest.raises(ChordError, match=r"Dependency \S+ raised TaskRevokedError\('expired'\)"):
        callback.get(timeout=60)
    assert callback.state == states.FAILURE
    assert not [r for r in runs(redis_client) if r["label"] == "expired"]


def test_a_stored_call_and_a_stored_chain_head_keep_the_callers_root(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    _start_cluster(processes)
    app = _app(make_app)
    record, add = app.tasks["tests.delays.record"], app.tasks["tests.delays.add"]
    rooted = record.apply_async(("rooted",), countdown=3)
    chained = chain(add.s(5, 5).set(countdown=3), record.si("after-chain")).apply_async()
    assert get_store(app).get(rooted.id) is not None

    # Each workflow is its own root, as Celery gives it without the store (not the sweep task's id).
    run = _run_of(redis_client, "rooted")
    assert (run["root_id"], run["parent_id"]) == (rooted.id, None)
    head = _run_of(redis_client, "add:5+5")
    after = _run_of(redis_client, "after-chain")
    assert (head["root_id"], head["parent_id"]) == (head["task_id"], None)
    assert (after["root_id"], after["parent_id"]) == (head["task_id"], head["task_id"])
    assert after["task_id"] == chained.id


@pytest.mark.parametrize("store_kind", ["sqlite", "postgresql"])
def test_a_row_whose_message_expires_in_the_broker_is_closed_without_waiting_for_the_grace(
    store_kind: str,
    broker_url: str,
    redis_url: str,
    request: pytest.FixtureRequest,
    make_app: Callable[..., Celery],
) -> None:
    """On Redis the message waits in the broker; RabbitMQ drops it at its TTL (no worker ever sees it)."""
    # The threshold is set: on RabbitMQ it would be half the consumer timeout.
    conf: dict[str, Any] = {
        "broker_url": broker_url,
        "safe_time_delay_threshold": 1.5,
        "safe_time_redis_url": redis_url,
    }
    if store_kind == "postgresql":
        # The session's database holds earlier tests' rows, which this test's sweeps would publish too.
        conf["safe_time_store_url"] = request.getfixturevalue("postgres_url")
        fresh_sql_store(conf["safe_time_store_url"]).engine.dispose()
    app = _app(make_app, **conf)
    store = get_store(app)
    # The first sweep (a new engine, the schema, the claim) must publish it before it expires: on a
    # loaded machine that took more than the 2 s an expiry of 4 s left.
    result = app.tasks["tests.delays.record"].apply_async(("late",), countdown=2, expires=10)

    def published() -> bool:
        sweep(app, lookahead=5)
        stored = store.get(result.id)
        return stored is not None and stored.status == C.STATUS_SENT

    wait_for(published, timeout=20, message="published ahead")
    row = store.get(result.id)
    assert row is not None
    # No worker takes it: its expiry passes in the broker, far inside the 300 s delivery grace.
    time.sleep(max(0.0, (row.expires_at - store.now()).total_seconds()) + 0.5)  # type: ignore[operator]
    stats = sweep(app)
    row = store.get(result.id)
    assert row is not None
    assert row.status == C.STATUS_EXPIRED
    assert stats.expired == 1
    assert stats.republished == 0
    assert result.state == states.REVOKED
    with pytest.raises(TaskRevokedError, match="expired"):
        result.get(timeout=5)


def test_revoking_a_published_stored_call_records_revoked_once(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    """The worker holds the row's eta message: the store drops it, no second REVOKED from the worker."""
    _start_cluster(processes)
    app = _app(make_app)
    result = app.tasks["tests.delays.record"].apply_async(("revoked",), countdown=6)
    store = get_store(app)
    wait_for(lambda: store.get(result.id).status == C.STATUS_SENT, timeout=30, message="published")  # type: ignore[union-attr]
    result.revoke()
    assert result.state == states.REVOKED
    worker = processes.procs[0]
    worker.wait_for_log(r"skipping a stale delivery of stored task tests\.delays\.record\[" + result.id, timeout=60)
    assert f"Discarding revoked task: tests.delays.record[{result.id}]" not in worker.log()
    with pytest.raises(TaskRevokedError, match="revoked"):
        result.get(timeout=5)
    assert not [r for r in runs(redis_client) if r["label"] == "revoked"]
