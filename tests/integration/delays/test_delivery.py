"""The delivery record with real workers: nothing lost, nothing twice (issue 13).

Each test here failed on the main before the delivery record (the Redis ``done:{task_id}:{retries}``
guard): a reused task id ran once, an acks_late task killed mid-run never ran again, a revoked
claimed row still ran, a retry of a claimed row was lost, a lost reply skipped the only run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.config import get_config
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.publish import publish_row
from celery_safe_time.delays.sweep import sweep
from tests.apps.delays_tasks import define_tasks
from tests.helpers import services
from tests.helpers.delays import DELAYS_APP, finished_row, fresh_sql_store, new_delay, runs
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration

#: Short heartbeat timeout so a killed run counts as dead within seconds; Redis and SQS redeliver unacked
#: messages after 5 s.
LOCK_TTL = 4.0
VISIBILITY_TIMEOUT = 5
BASE_CONF: dict[str, Any] = {
    "safe_time_delay_threshold": 1,
    "safe_time_lock_ttl": LOCK_TTL,
    "safe_time_delivery_grace": 3,
    "broker_transport_options": {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        **services.REDIS_FAST_RESTORE,
    },
}


class Setup:
    """One test's broker (Redis db, RabbitMQ vhost or SQS queue prefix), store, worker env and in-process app."""

    def __init__(self, make_app: Callable[..., Celery], broker_url: str, redis_url: str, store_url: str, **conf: Any):
        self.conf = {
            **BASE_CONF,
            "result_backend": redis_url,
            "safe_time_redis_url": redis_url,
            "safe_time_store_url": store_url,
            # on SQS: the endpoint's transport options, the same visibility timeout
            **services.broker_conf(broker_url, visibility_timeout=VISIBILITY_TIMEOUT),
            **conf,
        }
        self.env = {
            "SAFE_TIME_TEST_BROKER_URL": broker_url,
            "SAFE_TIME_TEST_RECORD_URL": redis_url,
            "SAFE_TIME_TEST_STORE_URL": store_url,
            "SAFE_TIME_TEST_APP_CONF": json.dumps(self.conf),
        }
        self.app = make_app("delivery-test", broker_url=broker_url, **self.conf)
        install(self.app)
        self.tasks = define_tasks(self.app)

    def worker(self, processes: ProcessManager, name: str, concurrency: int = 1, **env: str) -> CeleryProcess:
        proc = processes.worker(DELAYS_APP, name=name, env={**self.env, **env}, concurrency=concurrency)
        proc.wait_for_log(r"ready\.", timeout=90)
        return proc

    def sweep_until(self, done: Callable[[], bool], timeout: float, message: str) -> None:
        def swept() -> bool:
            sweep(self.app)
            return done()

        wait_for(swept, timeout, interval=0.3, message=message)


@pytest.fixture
def setup(make_app: Callable[..., Celery], redis_url: str, postgres_url: str) -> Iterator[Setup]:
    """On the Redis broker."""
    store = fresh_sql_store(postgres_url)
    yield Setup(make_app, redis_url, redis_url, postgres_url)
    store.close()


@pytest.fixture
def each_broker(make_app: Callable[..., Celery], broker_url: str, redis_url: str, postgres_url: str) -> Iterator[Setup]:
    """On Redis and on RabbitMQ (a vhost of its own); the record, result and lock Redis stay the test's db."""
    store = fresh_sql_store(postgres_url)
    yield Setup(make_app, broker_url, redis_url, postgres_url)
    store.close()


def ends(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange("test:ends", 0, -1)]


def test_a_reused_task_id_runs_every_time(setup: Setup, processes: ProcessManager, redis_client: redis.Redis) -> None:
    """Issue 13 item 2: three calls with the same task id a while apart are three runs."""
    setup.worker(processes, "w")
    for n in range(1, 4):
        setup.tasks["record"].apply_async((f"report-{n}",), task_id="daily-report", countdown=2)
        setup.sweep_until(lambda n=n: len(runs(redis_client)) >= n, 30, f"run {n} of the reused task id")
    time.sleep(1)
    assert [r["label"] for r in runs(redis_client)] == ["report-1", "report-2", "report-3"]
    row = finished_row(get_store(setup.app), "daily-report")
    assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 1)


def _kill_mid_run(setup: Setup, processes: ProcessManager, redis_client: redis.Redis, task: str) -> str:
    victim = setup.worker(processes, "victim")
    result = setup.tasks[task].apply_async(("killed",), {"seconds": 4.0}, countdown=1.5)
    setup.sweep_until(lambda: len(runs(redis_client)) >= 1, 30, "the first run to start")
    victim.kill()  # the whole process group: main process and pool child, mid-run
    victim.wait(10)
    return str(result.id)


@pytest.mark.parametrize("broker_url", ["redis", "amqp", "sqs"], indirect=True)
def test_acks_late_stored_task_killed_mid_run_runs_again_once_never_beside_itself(
    each_broker: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """Issue 13 "acks_late kept honest", on Redis and SQS (redelivery after visibility_timeout) and
    RabbitMQ (redelivery at once, while the dead run's heartbeat still looks fresh: the copy re-queues
    itself until it is stale, then takes over)."""
    setup = each_broker
    task_id = _kill_mid_run(setup, processes, redis_client, "slow")
    setup.worker(processes, "rescuer")
    setup.sweep_until(lambda: len(ends(redis_client)) >= 1, 60, "the task to run again and finish")
    time.sleep(LOCK_TTL)
    sweep(setup.app)
    starts = runs(redis_client)
    assert [r["task_id"] for r in starts] == [task_id, task_id]
    assert len(ends(redis_client)) == 1
    # Not beside the dead run: the second start waited for its heartbeat to stop.
    assert starts[1]["started"] - starts[0]["started"] >= LOCK_TTL * 0.9
    row = finished_row(get_store(setup.app), task_id)
    assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 2)


def test_stored_task_without_acks_late_killed_mid_run_runs_at_most_once_and_says_interrupted(
    each_broker: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    setup = each_broker
    task_id = _kill_mid_run(setup, processes, redis_client, "slow_once")
    setup.worker(processes, "after")

    def interrupted() -> bool:
        row = get_store(setup.app).get(task_id)
        return row is not None and row.outcome == C.OUTCOME_INTERRUPTED

    setup.sweep_until(interrupted, 30, "the killed run to be marked interrupted")
    time.sleep(LOCK_TTL + 2)
    sweep(setup.app)
    assert [r["task_id"] for r in runs(redis_client)] == [task_id]
    assert ends(redis_client) == []
    row = finished_row(get_store(setup.app), task_id)
    assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_INTERRUPTED, 1)


def test_revoking_a_claimed_or_sent_row_stops_its_delivery(
    setup: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """Issue 13 item 6: revoke() of a row the sweep has claimed, or already published with an eta,
    cancels it in the store; the message that is out is dropped by a worker that never saw the
    in-memory revoke."""
    store = get_store(setup.app)
    claimed = setup.tasks["record"].apply_async(("claimed",), countdown=30)
    sent = setup.tasks["record"].apply_async(("sent",), countdown=3)
    assert {r.id for r in store.claim_due(limit=10, lookahead=60, token="held")} == {claimed.id, sent.id}
    assert store.release([sent.id], "held") == 1
    claimed.revoke()  # a claimed row: cancelled, and the claim's later release does not revive it
    assert store.release([claimed.id], "held") == 0
    assert sweep(setup.app, lookahead=10).sent == 1  # "sent" goes out with its eta
    sent.revoke()
    for revoked in (claimed.id, sent.id):
        got = store.get(revoked)
        assert got is not None
        assert got.status == C.STATUS_CANCELLED
    worker = setup.worker(processes, "late")  # started after the broadcast: no revoke in memory
    worker.wait_for_log(r"skipping a stale delivery of stored task tests\.delays\.record\[" + sent.id, timeout=30)
    time.sleep(1)
    assert runs(redis_client) == []
    # As a revoked Celery task: REVOKED in the result backend, the claimed row's and the published one's.
    assert [setup.app.AsyncResult(i).state for i in (claimed.id, sent.id)] == ["REVOKED", "REVOKED"]


def test_retry_with_a_long_countdown_while_the_row_is_still_claimed_is_stored(
    setup: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """The sweep publishes a batch before it marks it sent; a task that starts in between and retries
    beyond the threshold must not hit "already stored and claimed" (StoreError, turned into Reject by
    retry(): lost). The start moves the row to started, the retry replaces it."""
    store = get_store(setup.app)
    config = get_config(setup.app)
    call = json.dumps({"args": ["retry-me", 30], "kwargs": {}, "options": {}}).encode()
    store.insert(
        new_delay("retry-me", store.now() - timedelta(seconds=1), task="tests.delays.retry_once", payload=call)
    )
    [row] = store.claim_due(limit=1, lookahead=0, token="slow-sweep")
    with setup.app.producer_or_acquire() as producer:  # published, never marked sent
        assert publish_row(setup.app, config, store, row, "slow-sweep", producer) == C.STATUS_SENT
    worker = setup.worker(processes, "w")
    worker.wait_for_log(r"retry_once\[retry-me\] retry", timeout=30)
    retried = store.get("retry-me")
    assert retried is not None
    assert retried.status == C.STATUS_PENDING
    assert retried.delivery_token != row.delivery_token
    assert store.mark_sent(["retry-me"], "slow-sweep") == 0  # the old claim is gone with the old row


def test_a_lost_reply_to_the_start_is_recognised_as_our_own(
    make_app: Callable[..., Celery],
    redis_url: str,
    postgres_url: str,
    setup: Setup,
    processes: ProcessManager,
    redis_client: redis.Redis,
) -> None:
    """Issue 13 item 4 (delivery half): the start was written, its reply lost. The re-queued copy
    carries the run id and takes the start over at once (without it, it would wait for a heartbeat
    that never comes: safe_time_lock_ttl, 60 s here)."""
    setup = Setup(
        make_app,
        redis_url,
        redis_url,
        postgres_url,
        safe_time_lock_ttl=60,
        broker_transport_options={"visibility_timeout": 60},
    )
    worker = setup.worker(processes, "w", DELAYS_TEST_LOSE_START_REPLY="1")
    result = setup.tasks["record"].apply_async(("lost-reply",), countdown=1.5)
    setup.sweep_until(lambda: len(runs(redis_client)) >= 1, 40, "the run after the lost reply")
    worker.wait_for_log(r"delivery record unavailable for stored task .* re-queued in", timeout=5)
    time.sleep(1)
    assert [r["task_id"] for r in runs(redis_client)] == [result.id]
    row = finished_row(get_store(setup.app), result.id)
    assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 2)


def test_a_reclaim_overtaking_a_slow_publisher_runs_each_row_once(
    make_app: Callable[..., Celery],
    redis_url: str,
    postgres_url: str,
    processes: ProcessManager,
    redis_client: redis.Redis,
) -> None:
    """Issue 13 item 7: a sweeper whose publishing stalls past half the claim timeout (a broker
    memory alarm, a pause) stops and hands the rest back; rows another sweeper reclaimed and
    published meanwhile went out twice at most, and each runs once."""
    store = fresh_sql_store(postgres_url)
    # a 3 s claim: the first publish (the broker connection made, the queue declared) must end within
    # half of it; with 1 s a loaded CI took longer, so the sweeper handed back before the stall
    setup = Setup(make_app, redis_url, redis_url, postgres_url, safe_time_claim_timeout=3)
    ids = [f"slow-{i}" for i in range(6)]
    store.bulk_insert([new_delay(i, store.now() - timedelta(seconds=1)) for i in ids])
    publishes: list[str] = []
    stalled = threading.Event()

    def stall_second(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get(C.HEADER_STORED) and threading.current_thread().name == "slow-sweeper":
            publishes.append(str(headers["id"]))
            if len(publishes) == 2:
                stalled.set()
                time.sleep(3.5)  # past the claim timeout: another sweeper reclaims meanwhile

    before_task_publish.connect(stall_second, weak=False)
    try:
        results: dict[str, Any] = {}
        slow = threading.Thread(target=lambda: results.update(stats=sweep(setup.app)), name="slow-sweeper")
        slow.start()
        assert stalled.wait(10)
        time.sleep(3.1)
        fast = sweep(setup.app)
        slow.join(10)
    finally:
        before_task_publish.disconnect(stall_second)
    assert fast.reclaimed == 6
    assert fast.sent == 6
    assert results["stats"].abandoned == 4  # the slow one stopped after its stalled publish
    assert len(publishes) == 2
    setup.worker(processes, "w", concurrency=2)
    wait_for(lambda: len(runs(redis_client)) >= 6, 30, message="6 runs")
    time.sleep(1.5)
    assert sorted(r["task_id"] for r in runs(redis_client)) == ids
    store.close()


def test_a_lock_requeue_longer_than_the_threshold_is_stored_and_runs(
    setup: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """Issue 13 item 3: an overlap-lock re-queue (retry_after 2 s) beyond the delay threshold (1 s)
    goes through the store with the same task id and retry count; each such copy is a new delivery
    (a new token), so the second one is not dropped as a repeat of the first."""
    setup.worker(processes, "w", concurrency=2)
    holder = setup.tasks["locked_slow"].apply_async(("k", "holder", 7.0))
    wait_for(lambda: len(runs(redis_client)) >= 1, 30, message="the holder to start")
    waiter = setup.tasks["locked_slow"].apply_async(("k", "waiter", 0.0))
    setup.sweep_until(lambda: len(ends(redis_client)) >= 2, 60, "the waiter to run after the holder")
    labels = [r["label"] for r in runs(redis_client)]
    assert labels == ["holder", "waiter"]
    row = finished_row(get_store(setup.app), waiter.id)  # it went through the store at least once
    assert row.outcome == C.OUTCOME_SUCCEEDED
    assert holder.id != waiter.id


@pytest.mark.parametrize(
    "task_name",
    [
        # the body raises ``Reject(requeue=True)`` once
        "reject_once",
        # the body raises ``SystemExit`` once: with ``reject_on_worker_lost`` the pool child goes and the
        # message goes back to the queue
        "exit_once",
    ],
)
def test_a_stored_delivery_that_gives_its_message_back_runs_again_and_ends_finished(
    setup: Setup, processes: ProcessManager, redis_client: redis.Redis, task_name: str
) -> None:
    """An acks_late stored task whose first run gives its message back to the broker: the redelivery of
    that message finds the row startable again (not finished as ignored or failed), runs, and records
    the end."""
    setup.worker(processes, "w")
    result = setup.tasks[task_name].apply_async((task_name,), countdown=1.5)
    setup.sweep_until(lambda: len(ends(redis_client)) >= 1, 30, "the run after the message came back")
    row = finished_row(get_store(setup.app), result.id)
    assert [r["task_id"] for r in runs(redis_client)] == [result.id, result.id]
    assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 2)


def test_a_retry_with_a_long_countdown_from_a_run_started_again_is_stored_and_runs(
    setup: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """The sweep put the row of a killed acks_late run back and started it again; that run calls
    ``retry(countdown)`` past the delay threshold: the retry replaces the row (it is not refused as
    "already stored") and runs."""
    victim = setup.worker(processes, "victim")
    result = setup.tasks["retry_on_rerun"].apply_async(("rerun",), {"countdown": 2.0}, countdown=1.5)
    setup.sweep_until(lambda: len(runs(redis_client)) >= 1, 30, "the first run to start")
    victim.kill()
    victim.wait(10)
    setup.worker(processes, "rescuer")
    setup.sweep_until(lambda: len(ends(redis_client)) >= 1, 60, "the retry of the run started again to end")
    assert [(r["task_id"], r["retries"]) for r in runs(redis_client)] == [
        (result.id, 0),
        (result.id, 0),
        (result.id, 1),
    ]
    row = finished_row(get_store(setup.app), result.id)
    assert (row.status, row.outcome) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED)


def test_a_row_published_ahead_with_its_eta_never_runs_early_on_a_worker_whose_clock_is_fast(
    setup: Setup, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """The sweep publishes a row due soon with its ``eta``; a worker whose clock is 3 s fast would
    start it 3 s early. The start checks the due time against the store's clock and re-queues the
    copy for the rest: it runs at its due time, at most ``safe_time_max_clock_skew`` early."""
    worker = setup.worker(processes, "fast", DELAYS_TEST_CLOCK_AHEAD="3")
    setup.tasks["record"].apply_async(("ahead",), countdown=6)
    assert sweep(setup.app, lookahead=10).sent == 1  # out at once, with its eta
    setup.sweep_until(lambda: len(runs(redis_client)) >= 1, 30, "the row to run")
    [run] = runs(redis_client)
    due = datetime.fromisoformat(run["stored_due"]).timestamp()
    assert run["started"] >= due - get_config(setup.app).max_clock_skew, run["started"] - due
    worker.wait_for_log(r"before its due time by the store.s clock", timeout=5)
