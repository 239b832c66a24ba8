"""SQS (issue 42): stored delays, workers and beat on a local SQS-compatible endpoint (moto's server
mode, ``sqs_endpoint``), with a 10 s visibility timeout.

A message a worker holds unacknowledged past the visibility timeout is handed out again: a plain
countdown past it runs more than once, a SafeTask's stays in the store until it is due and runs once.
Runs, results, locks and leases stay on the test's Redis db; queues are kept apart per test by a
queue name prefix of its own.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import entry_history, install, save_entries
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.exceptions import SerializationError
from celery_safe_time.locks.backends import get_lock_backend
from celery_safe_time.locks.entry_runs import entry_key
from tests.apps.delays_tasks import define_tasks
from tests.helpers.beat import BEAT_APP, beat_env, burst_cron, burst_hour, duplicates, leader_at_burst
from tests.helpers.beat import runs as beat_runs
from tests.helpers.delays import DELAYS_APP, fresh_sql_store, new_delay, runs, seconds
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import SqsEndpoint, sqs_transport_options

pytestmark = pytest.mark.integration

#: Below half the 10 s visibility timeout (the package refuses more): longer countdowns are stored.
THRESHOLD = 4


@pytest.fixture
def sqs(sqs_endpoint: SqsEndpoint) -> dict[str, Any]:
    """Broker settings of this test's own on the shared endpoint."""
    prefix = f"t{uuid.uuid4().hex[:10]}-"
    return {"broker_url": sqs_endpoint.url, "broker_transport_options": sqs_transport_options(prefix)}


def _conf(sqs: dict[str, Any], redis_url: str, postgres_url: str, **extra: Any) -> dict[str, Any]:
    return {
        **sqs,
        "result_backend": redis_url,
        "safe_time_redis_url": redis_url,
        "safe_time_store_url": postgres_url,
        "safe_time_delay_threshold": THRESHOLD,
        **extra,
    }


def _env(conf: dict[str, Any], redis_url: str) -> dict[str, str]:
    return {
        "SAFE_TIME_TEST_BROKER_URL": conf["broker_url"],
        "SAFE_TIME_TEST_RECORD_URL": redis_url,
        "SAFE_TIME_TEST_STORE_URL": conf["safe_time_store_url"],
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }


class Sweeper:
    """Beat's sweep entry in the test process: a sweep every half second."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            sweep(self.app)
            self.stop_event.wait(0.5)

    def __enter__(self) -> Sweeper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(10)


@pytest.fixture
def conf(sqs: dict[str, Any], redis_url: str, postgres_url: str) -> dict[str, Any]:
    """The client's and the workers' settings (on an empty store)."""
    fresh_sql_store(postgres_url).close()
    return _conf(sqs, redis_url, postgres_url)


@pytest.fixture
def safe_app(make_app: Callable[..., Celery], conf: dict[str, Any]) -> Celery:
    app = make_app("sqs-client", **conf)
    install(app)
    define_tasks(app)
    return app


def test_a_countdown_past_the_visibility_timeout_runs_once_as_a_safe_task_and_more_than_once_plain(
    safe_app: Celery, conf: dict[str, Any], redis_url: str, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """Side by side on one worker: a plain 20 s countdown is held unacknowledged by the worker, SQS
    hands it out again after the 10 s visibility timeout, and it runs more than once (celery#3270);
    the SafeTask's 20 s countdown waits in the store, reaches the worker just before it is due and
    runs once."""
    tasks = safe_app.tasks
    worker = processes.worker(DELAYS_APP, name="w", env=_env(conf, redis_url))
    worker.wait_for_log(r"ready\.", timeout=90)
    tasks["tests.delays.plain_record"].apply_async(("plain",), countdown=20)
    tasks["tests.delays.record"].apply_async(("safe",), countdown=20)
    assert len(get_store(safe_app).list(limit=10)) == 1  # the SafeTask's call is stored, not published
    with Sweeper(safe_app):
        wait_for(lambda: {r["label"] for r in runs(redis_client)} >= {"plain", "safe"}, 60, message="both to run")
        # a plain duplicate comes once the worker's held copy is handed out again: every 10 s
        wait_for(lambda: Counter(r["label"] for r in runs(redis_client))["plain"] > 1, 30, message="a plain duplicate")
        time.sleep(3)
    count = Counter(r["label"] for r in runs(redis_client))
    print(f"20 s countdown, 10 s visibility timeout: plain ran {count['plain']} times, SafeTask {count['safe']}")
    assert count["plain"] > 1
    assert count["safe"] == 1


def test_twenty_stored_calls_on_two_workers_each_run_once(
    safe_app: Celery, conf: dict[str, Any], redis_url: str, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """20 countdowns past the threshold go to the store; the sweep publishes each when it is due and
    two workers share the queue: every call runs exactly once."""
    env = _env(conf, redis_url)
    workers = [processes.worker(DELAYS_APP, name=f"w{i}", env=env, concurrency=2) for i in range(2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.", timeout=90)
    labels = [f"call-{i:02d}" for i in range(20)]
    for n, label in enumerate(labels):
        safe_app.tasks["tests.delays.record"].apply_async((label,), countdown=THRESHOLD + 2 + n % 3)
    assert len(get_store(safe_app).list(limit=50)) == len(labels)
    with Sweeper(safe_app):
        wait_for(lambda: len(runs(redis_client)) >= len(labels), 60, message="every call to run")
        time.sleep(3)  # a second copy would come now, not later: the sweep is done with every row
    count = Counter(r["label"] for r in runs(redis_client))
    assert count == Counter(labels)
    print(f"20 stored calls on 2 workers: {len({r['hostname'] for r in runs(redis_client)})} workers ran them")


def test_two_safe_beats_on_sqs_publish_each_slot_at_most_once(
    sqs: dict[str, Any], redis_url: str, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """Two SafeScheduler beats (the lease on the test's Redis db) and a worker, every task message on
    SQS: each 1 s slot runs at most once."""
    env = {
        "SAFE_TIME_TEST_BROKER_URL": sqs["broker_url"],
        "SAFE_TIME_TEST_RECORD_URL": redis_url,
        **beat_env(
            {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}},
            broker_transport_options=sqs["broker_transport_options"],
            result_backend=redis_url,
            safe_time_redis_url=redis_url,
            safe_time_beat_lease=6,
        ),
    }
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(2)]
    wait_for(lambda: len(beat_runs(redis_client, "fast")) >= 8, 90, message="eight slots to run")
    assert all(b.alive() for b in beats)
    assert duplicates(redis_client) == {}


def test_a_threshold_above_sqs_longest_delay_is_refused_naming_the_setting(
    conf: dict[str, Any], redis_url: str, processes: ProcessManager
) -> None:
    """A worker told a threshold past SQS's 900 s DelaySeconds (with a visibility timeout long enough
    for it) refuses to start, naming the setting."""
    transport = {**conf["broker_transport_options"], "visibility_timeout": 43200}
    bad = {**conf, "broker_transport_options": transport, "safe_time_delay_threshold": 1000}
    worker = processes.worker(DELAYS_APP, name="bad", env=_env(bad, redis_url))
    assert worker.wait(60) != 0
    assert "safe_time_delay_threshold" in worker.log()
    assert "DelaySeconds at most 900 s" in worker.log()


def _queue_messages(endpoint: SqsEndpoint, name: str) -> list[dict[str, Any]]:
    """Every message in the SQS queue ``name`` (received and deleted)."""
    client = endpoint.client()
    url = client.get_queue_url(QueueName=name)["QueueUrl"]
    out: list[dict[str, Any]] = []
    while True:
        got = client.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1, AttributeNames=["All"], VisibilityTimeout=30
        ).get("Messages", [])
        if not got:
            return out
        out.extend(got)
        for message in got:
            client.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])


def test_a_fifo_queue_gets_each_stored_row_once_when_the_sweep_publishes_it_again(
    make_app: Callable[..., Celery], conf: dict[str, Any], sqs_endpoint: SqsEndpoint
) -> None:
    """Stored calls routed to a ``.fifo`` queue, no worker: the first sweep publishes each row, a later
    sweep publishes each again (never started within the 1 s delivery grace: the message looks lost).
    The second copies carry the same ``MessageDeduplicationId`` (from the row's delivery token), so SQS
    drops them: the queue holds each row once, each in a message group of its own."""
    app = make_app("sqs-fifo", **{**conf, "task_default_queue": "celery.fifo", "safe_time_delivery_grace": 1})
    install(app)
    define_tasks(app)
    labels = [f"fifo-{i}" for i in range(3)]
    ids = [app.tasks["tests.delays.record"].apply_async((label,), countdown=THRESHOLD + 1).id for label in labels]
    time.sleep(THRESHOLD + 1)
    assert sweep(app).sent == len(ids)
    time.sleep(1.5)
    again = sweep(app)
    assert (again.republished, again.sent) == (len(ids), len(ids))
    prefix = conf["broker_transport_options"]["queue_name_prefix"]
    messages = _queue_messages(sqs_endpoint, f"{prefix}celery.fifo")
    task_ids = [json.loads(base64.b64decode(m["Body"]))["headers"]["id"] for m in messages]
    assert sorted(task_ids) == sorted(ids)
    assert {m["Attributes"]["MessageGroupId"] for m in messages} == set(ids)


#: The queues' MaximumMessageSize: SQS's default before it took 1 MiB, and what the check assumes.
SMALL_QUEUES = {"sqs-creation-attributes": {"MaximumMessageSize": "262144"}}


def test_a_stored_call_too_large_for_sqs_is_refused_at_the_call_site_and_one_just_below_is_delivered(
    make_app: Callable[..., Celery], conf: dict[str, Any], sqs_endpoint: SqsEndpoint
) -> None:
    """A stored call whose message would pass SQS's 256 KiB is refused when it is made (nothing
    stored), not by SQS in a sweep long after the caller is gone; one just below the check's estimate
    goes through the sweep into the queue (the estimate is not lax)."""
    transport = {**conf["broker_transport_options"], **SMALL_QUEUES}
    app = make_app("sqs-size", **{**conf, "broker_transport_options": transport})
    install(app)
    define_tasks(app)
    record = app.tasks["tests.delays.record"]
    with pytest.raises(SerializationError, match=r"above the SQS message size limit \(262144 bytes"):
        record.apply_async(("x" * 150_000,), countdown=THRESHOLD + 1)
    assert get_store(app).list(limit=10) == []
    # The largest payload the estimate lets through is about 145 900 bytes.
    fits = record.apply_async(("x" * 145_000,), countdown=THRESHOLD + 1)
    time.sleep(THRESHOLD + 1)
    stats = sweep(app)
    assert (stats.sent, stats.failed) == (1, 0)
    messages = _queue_messages(sqs_endpoint, f"{transport['queue_name_prefix']}celery")
    assert [json.loads(base64.b64decode(m["Body"]))["headers"]["id"] for m in messages] == [fits.id]
    print(f"a 145 000-byte argument: a {len(messages[0]['Body'])}-byte SQS message (limit 262144)")


def _due_rows(app: Celery, n: int, prefix: str) -> list[str]:
    store = get_store(app)
    now = store.now()
    ids = [f"{prefix}-{i:02d}" for i in range(n)]
    for i, task_id in enumerate(ids):
        store.insert(new_delay(task_id, now - seconds(60) + seconds(i * 0.001)))
    return ids


def test_the_sweep_publishes_to_sqs_in_batches_of_ten_and_each_row_arrives_once(
    make_app: Callable[..., Celery], conf: dict[str, Any], sqs_endpoint: SqsEndpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """25 due rows: one claim, three ``SendMessageBatch`` calls (10, 10, 5) instead of 25
    ``SendMessage``; every row is marked sent and its message is in the queue once, with its headers."""
    app = make_app("sqs-batch", **conf)
    install(app)
    define_tasks(app)
    ids = _due_rows(app, 25, "batch")
    with caplog.at_level(logging.DEBUG, logger="celery_safe_time.messages.sqs_batch"):
        stats = sweep(app)
    assert (stats.sent, stats.failed) == (25, 0)
    assert "published 25 messages to SQS in 3 SendMessageBatch calls" in caplog.text
    prefix = conf["broker_transport_options"]["queue_name_prefix"]
    bodies = [json.loads(base64.b64decode(m["Body"])) for m in _queue_messages(sqs_endpoint, f"{prefix}celery")]
    assert sorted(b["headers"]["id"] for b in bodies) == ids
    assert all(b["headers"]["task"] == "tests.delays.record" for b in bodies)
    assert all(b["headers"].get(C.HEADER_STORED) for b in bodies)


def test_a_row_sqs_refuses_in_a_batch_is_marked_failed_and_the_rest_of_the_batch_is_sent(
    make_app: Callable[..., Celery], conf: dict[str, Any], sqs_endpoint: SqsEndpoint
) -> None:
    """A queue that takes 4 KiB messages and a batch of 5 rows, one of them larger (written to the
    store directly, past the call-site check): SQS refuses that entry as the sender's fault. The row
    is marked failed with SQS's reason, as a row whose single publish is refused; the other four are
    sent and in the queue once; the sweep goes on."""
    transport = {**conf["broker_transport_options"], "sqs-creation-attributes": {"MaximumMessageSize": "4096"}}
    app = make_app("sqs-batch-refused", **{**conf, "broker_transport_options": transport})
    install(app)
    define_tasks(app)
    store = get_store(app)
    ids = _due_rows(app, 4, "small")
    big = new_delay("big", store.now() - seconds(30))
    store.insert(dataclasses.replace(big, payload=json.dumps({"args": ["x" * 4000], "kwargs": {}}).encode()))
    stats = sweep(app)
    assert (stats.sent, stats.failed) == (4, 1)
    failed = store.get("big")
    assert failed is not None
    assert failed.status == C.STATUS_FAILED
    assert "shorter than 4096 bytes" in (failed.last_error or ""), failed.last_error
    bodies = [
        json.loads(base64.b64decode(m["Body"]))
        for m in _queue_messages(sqs_endpoint, f"{transport['queue_name_prefix']}celery")
    ]
    assert sorted(b["headers"]["id"] for b in bodies) == ids


def test_an_overlap_lock_on_sqs_runs_one_key_at_a_time_and_each_call_once(
    safe_app: Celery, conf: dict[str, Any], redis_url: str, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """Three 2 s calls of one lock key on two workers: the calls that meet the held lock are re-queued
    (2 s countdowns on SQS, below the visibility timeout) and run after the holder, never beside it;
    each runs once."""
    env = _env(conf, redis_url)
    for i in range(2):
        processes.worker(DELAYS_APP, name=f"w{i}", env=env, concurrency=2).wait_for_log(r"ready\.", timeout=90)
    calls = [safe_app.tasks["tests.delays.locked_slow"].delay("k", f"lock-{i}", 2.0) for i in range(3)]
    with Sweeper(safe_app):
        wait_for(lambda: redis_client.llen("test:ends") >= len(calls), 90, message="every call to end")
        time.sleep(2)
    started = {r["task_id"]: r["started"] for r in runs(redis_client)}
    ended = {e["task_id"]: e["ended"] for e in map(json.loads, redis_client.lrange("test:ends", 0, -1))}
    assert sorted(started) == sorted(c.id for c in calls)
    assert len(runs(redis_client)) == len(calls)
    spans = sorted((started[i], ended[i]) for i in started)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end - 0.05, spans  # the next run starts after the previous one ended


def test_an_acks_late_run_longer_than_the_visibility_timeout_runs_once(
    safe_app: Celery, conf: dict[str, Any], redis_url: str, processes: ProcessManager, redis_client: redis.Redis
) -> None:
    """A stored acks_late call whose run (14 s) outlasts the 10 s visibility timeout: SQS hands its
    message out again while it runs, and the delivery record drops that copy instead of running it
    beside the first."""
    env = _env(conf, redis_url)
    workers = [processes.worker(DELAYS_APP, name=f"w{i}", env=env, concurrency=2) for i in range(2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.", timeout=90)
    call = safe_app.tasks["tests.delays.slow"].apply_async(("long",), {"seconds": 14.0}, countdown=THRESHOLD + 1)
    with Sweeper(safe_app):
        wait_for(lambda: redis_client.llen("test:ends") >= 1, 60, message="the run to end")
        time.sleep(6)  # a copy handed out at 10 s would have started by now
    assert [r["task_id"] for r in runs(redis_client)] == [call.id]
    logs = "".join(w.log() for w in workers)
    assert f"[{call.id}] is running on" in logs, "SQS never handed the message out again: nothing was shown"


def _noop(*args: Any) -> None:
    return None


def test_a_beat_tick_with_many_slots_due_publishes_to_sqs_in_batches_and_records_a_refused_one(
    make_app: Callable[..., Celery],
    sqs: dict[str, Any],
    redis_url: str,
    sqs_endpoint: SqsEndpoint,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """25 runtime entries due at the same minute and one whose message is larger than the queue takes
    (4 KiB): the leader's tick publishes them in ``SendMessageBatch`` calls of 10 (not 26
    ``SendMessage``: a new leader catching up a failover's slots on SQS waited a round trip per slot),
    each slot once in the queue; SQS refuses the large one's chunk whole, so that chunk goes one by
    one: the large one is logged and recorded as not published (its overlap marker freed, so its next
    slot is not dropped as queued), the rest of its chunk goes out."""
    transport = {**sqs["broker_transport_options"], "sqs-creation-attributes": {"MaximumMessageSize": "4096"}}
    app = make_app(
        "sqs-beat-batch",
        broker_url=sqs["broker_url"],
        broker_transport_options=transport,
        safe_time_redis_url=redis_url,
        safe_time_beat_lease=3,
        beat_schedule={},
    )
    app.task(name="t.sqs_burst", shared=False)(_noop)
    hour = burst_hour(time.time())
    cron = burst_cron(hour)
    entries = [{"name": f"tenant-{i:02d}", "task": "t.sqs_burst", "schedule": cron, "args": [i]} for i in range(25)]
    # under an overlap policy, the refused one's queued marker goes back; a published one keeps its own
    entries[0]["overlap"] = "skip"
    entries.append(
        {"name": "too-large", "task": "t.sqs_burst", "schedule": cron, "args": ["x" * 5000], "overlap": "skip"}
    )
    assert save_entries(entries, app=app) == 26
    caplog.set_level(logging.DEBUG, logger="celery_safe_time")
    sched, burst = leader_at_burst(app, tmp_path, hour)
    try:
        wait_for(lambda: (sched.tick(), entry_history("too-large", app=app))[1], 30, interval=0.05)
    finally:
        sched.close()
    slot = datetime.fromtimestamp(burst, timezone.utc).isoformat()
    bodies = [
        json.loads(base64.b64decode(m["Body"]))
        for m in _queue_messages(sqs_endpoint, f"{transport['queue_name_prefix']}celery")
    ]
    published = sorted((b["headers"][C.HEADER_ENTRY], b["headers"][C.HEADER_SLOT]) for b in bodies)
    assert published == [(f"tenant-{i:02d}", slot) for i in range(25)]  # each slot once, the large one not
    # 26 recorded: the chunk of the large one is refused whole and sent one by one (6 calls)
    assert "published 26 messages to SQS in 8 SendMessageBatch calls" in caplog.text
    assert "beat: published 25 due slot(s) in one batch" in caplog.text
    assert "beat: entry 'too-large' slot" in caplog.text
    assert "not published: SQS refused the message" in caplog.text
    [record] = entry_history("too-large", app=app)
    assert record.outcome == C.RUN_NOT_PUBLISHED
    markers = get_lock_backend(app)
    assert markers.unique_info(entry_key("too-large"), time.time()) is None
    assert markers.unique_info(entry_key("tenant-00"), time.time()) is not None
