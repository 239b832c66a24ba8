"""Durable delays end to end: real workers, beat, sweepers (subprocesses), Redis and stores."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery, chain

from celery_safe_time import cancel, install, reschedule
from celery_safe_time import constants as C
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore, delays
from celery_safe_time.delays.sweep import sweep
from tests.apps.delays_tasks import define_tasks
from tests.faults.proxy import proxy_for
from tests.helpers.delays import DELAYS_APP, finished_row, fresh_sql_store, new_delay, runs
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for
from tests.helpers.services import REDIS_FAST_RESTORE, RedisServer, broker_conf

pytestmark = pytest.mark.integration

#: Short visibility timeout so the plain-Celery bug shows within seconds; threshold = 1.5 s.
#: kombu 5.7 scans for expired unacked messages every interval x throttle (100 s by default):
#: scan every second so the redelivery shows up in seconds instead of minutes.
CONF: dict[str, Any] = {
    "broker_transport_options": {"visibility_timeout": 3, **REDIS_FAST_RESTORE},
    "safe_time_sweep_interval": 1,
}


def env_for(conf: dict[str, Any], **extra: str) -> dict[str, str]:
    return {"SAFE_TIME_TEST_APP_CONF": json.dumps(conf), **extra}


def test_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    app = make_app("delays-test", **{**CONF, **conf})
    install(app)
    define_tasks(app)
    return app


test_app.__test__ = False  # type: ignore[attr-defined]


def start_cluster(processes: ProcessManager, conf: dict[str, Any], workers: int = 2, **env: str) -> list[CeleryProcess]:
    procs = [processes.worker(DELAYS_APP, name=f"w{i}", env=env_for(conf, **env)) for i in range(workers)]
    procs.append(
        processes.beat(DELAYS_APP, name="beat", env=env_for(conf, **env), scheduler="celery.beat:PersistentScheduler")
    )
    for proc in procs[:-1]:
        proc.wait_for_log(r"ready\.", timeout=90)
    return procs


def by_label(client: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    result: dict[str, list[dict[str, Any]]] = {}
    for run in runs(client):
        result.setdefault(run["label"], []).append(run)
    return result


def in_broker(client: redis.Redis, task_id: str) -> bool:
    """Is a message for ``task_id`` in the default queue or kombu's unacked hash?"""
    raw = client.lrange("celery", 0, -1) + list(client.hvals("unacked"))
    return any(task_id.encode() in item for item in raw)


def test_long_countdown_runs_more_than_once_on_plain_celery_and_exactly_once_with_safetask(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    start_cluster(processes, CONF)
    app = test_app(make_app)
    plain = app.tasks["tests.delays.plain_record"].apply_async(("plain",), countdown=12)
    safe = app.tasks["tests.delays.record"].apply_async(("safe",), countdown=12)
    time.sleep(1.0)
    # While pending: a row in the store, nothing in the broker or in any worker's memory.
    row = get_store(app).get(safe.id)
    assert row is not None
    assert row.status == C.STATUS_PENDING
    assert not in_broker(redis_client, safe.id)
    scheduled = app.control.inspect(timeout=3).scheduled() or {}
    held = [r["request"]["id"] for reqs in scheduled.values() for r in reqs]
    assert plain.id in held
    assert safe.id not in held

    wait_for(lambda: len(by_label(redis_client).get("plain", [])) >= 2, timeout=60, message="plain task rerun")
    wait_for(lambda: by_label(redis_client).get("safe"), timeout=30, message="safe task run")
    time.sleep(4)  # a visibility timeout and then some: no second run may appear
    labels = by_label(redis_client)
    assert len(labels["safe"]) == 1, labels["safe"]
    assert len(labels["plain"]) >= 2
    run = labels["safe"][0]
    due = datetime.fromisoformat(run["stored_due"])
    # Fired at due_at (eta), not on the sweep grid.
    assert -0.5 < run["started"] - due.timestamp() < 1.5
    record = finished_row(get_store(app), safe.id)
    assert (record.status, record.outcome, record.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 1)


def test_flushall_while_pending_loses_nothing(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_server: RedisServer
) -> None:
    url = redis_server.url
    start_cluster(processes, CONF, SAFE_TIME_TEST_BROKER_URL=url)
    app = test_app(make_app, broker_url=url, result_backend=url)
    ids = [app.tasks["tests.delays.record"].apply_async((f"f{i}",), countdown=6).id for i in range(5)]
    client = redis.Redis.from_url(url)
    client.flushall()
    wait_for(lambda: len(runs(client)) >= 5, timeout=60, message="5 runs after FLUSHALL")
    time.sleep(2)
    done = runs(client)
    assert sorted(r["task_id"] for r in done) == sorted(ids)
    client.close()


def on_broker(broker_url: str, redis_url: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Settings and worker env for ``broker_url``: on RabbitMQ and SQS the record, results and locks stay
    on the test's Redis db, and the threshold is set (on RabbitMQ no visibility timeout to derive it
    from; SQS's 10 s one would give 5 s)."""
    if broker_url == redis_url:
        return CONF, {}
    conf = {
        **CONF,
        "safe_time_delay_threshold": 1.5,
        "safe_time_redis_url": redis_url,
        "result_backend": redis_url,
        **broker_conf(broker_url),
    }
    return conf, {"SAFE_TIME_TEST_BROKER_URL": broker_url, "SAFE_TIME_TEST_RECORD_URL": redis_url}


@pytest.mark.parametrize("broker_url", ["redis", "amqp", "sqs"], indirect=True)
def test_cancel_revoke_reschedule_retry_signatures_chains_and_expires(
    processes: ProcessManager,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    broker_url: str,
    redis_url: str,
) -> None:
    """On Redis, on RabbitMQ (the sweep publishes with publisher confirms there) and on SQS (in
    ``SendMessageBatch`` calls)."""
    conf, env = on_broker(broker_url, redis_url)
    start_cluster(processes, conf, **env)
    # the settings on_broker adds or replaces (on SQS the transport options too)
    app = test_app(make_app, broker_url=broker_url, **{k: v for k, v in conf.items() if CONF.get(k) != v})
    record = app.tasks["tests.delays.record"]
    add = app.tasks["tests.delays.add"]
    store = get_store(app)
    cancelled = record.apply_async(("cancelled",), countdown=5)
    revoked = record.apply_async(("revoked",), countdown=5)
    earlier = record.apply_async(("earlier",), countdown=3600)
    later = record.apply_async(("later",), countdown=5)
    expired = record.apply_async(("expired",), countdown=5, expires=3)
    app.tasks["tests.delays.retry_once"].apply_async(("retried",), kwargs={"countdown": 4})
    signature = add.s(2, 3).set(countdown=5).apply_async()
    chain(add.s(1, 2).set(countdown=5), record.si("after-chain")).apply_async()

    assert cancel(cancelled.id, app=app)
    revoked.revoke()
    assert reschedule(earlier.id, countdown=3, app=app)
    assert reschedule(later.id, countdown=3600, app=app)
    assert store.get(signature.id) is not None

    wait_for(lambda: len(by_label(redis_client).get("retried", [])) >= 2, timeout=60, message="retried twice")
    wait_for(lambda: by_label(redis_client).get("after-chain"), timeout=60, message="chain continued")
    wait_for(lambda: by_label(redis_client).get("earlier"), timeout=30, message="earlier ran")
    wait_for(lambda: store.get(expired.id).status == C.STATUS_EXPIRED, timeout=30, message="expired")  # type: ignore[union-attr]
    time.sleep(2)
    labels = by_label(redis_client)
    assert "cancelled" not in labels
    assert "revoked" not in labels
    assert "later" not in labels
    assert "expired" not in labels
    assert len(labels["earlier"]) == 1
    assert len(labels["add:2+3"]) == 1
    assert signature.get(timeout=10) == 5
    retries = labels["retried"]
    assert [r["retries"] for r in retries] == [0, 1]
    assert retries[1]["stored_due"] is not None  # the retry went through the store
    assert retries[1]["started"] - retries[0]["started"] > 3.5
    assert len(labels["add:1+2"]) == 1
    assert store.get(cancelled.id).status == C.STATUS_CANCELLED  # type: ignore[union-attr]
    assert store.get(revoked.id).status == C.STATUS_CANCELLED  # type: ignore[union-attr]
    assert store.get(later.id).status == C.STATUS_PENDING  # type: ignore[union-attr]
    assert not cancel(cancelled.id, app=app)
    # What Celery's worker records for a message it discards: REVOKED, with its reason.
    assert [r.state for r in (cancelled, revoked, expired, later)] == ["REVOKED", "REVOKED", "REVOKED", "PENDING"]
    assert str(expired.result) == "expired"
    assert str(cancelled.result) == "revoked"


# --- sweepers on PostgreSQL ---------------------------------------------------------


def _queued_ids(client: redis.Redis) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in client.lrange("celery", 0, -1)]


def _sweeper(processes: ProcessManager, name: str, env: dict[str, str]) -> CeleryProcess:
    proc = CeleryProcess(DELAYS_APP, ["safe-time", "sweep"], {**processes.env, **env}, processes.log_dir, name)
    processes.procs.append(proc)
    return proc.start()


def _seed(store: SQLAlchemyStore, count: int, due: datetime, prefix: str = "row") -> list[str]:
    ids = [f"{prefix}-{i:06d}" for i in range(count)]
    store.bulk_insert([new_delay(i, due) for i in ids])
    return ids


def test_four_sweepers_publish_20000_rows_exactly_once(
    processes: ProcessManager, postgres_url: str, redis_client: redis.Redis
) -> None:
    store = fresh_sql_store(postgres_url)
    ids = _seed(store, 20_000, store.now() - timedelta(seconds=1))
    env = env_for({"safe_time_store_url": postgres_url, "safe_time_sweep_batch": 250})
    sweepers = [_sweeper(processes, f"sweeper{i}", env) for i in range(4)]
    for proc in sweepers:
        assert proc.wait(180) == 0, proc.log()[-3000:]
    sent = [json.loads(p.log()[p.log().index("{") :])["sent"] for p in sweepers]
    queued = _queued_ids(redis_client)
    assert sum(sent) == 20_000
    assert len(queued) == 20_000
    assert set(queued) == set(ids)
    assert sum(1 for n in sent if n) >= 2, sent  # they really ran side by side
    assert store.counts()[C.STATUS_SENT] == 20_000
    store.close()


def test_killed_sweeper_rows_are_republished_after_claim_timeout_and_run_once(
    processes: ProcessManager, postgres_url: str, redis_client: redis.Redis, make_app: Callable[..., Celery]
) -> None:
    store = fresh_sql_store(postgres_url)
    conf = {"safe_time_store_url": postgres_url, "safe_time_claim_timeout": 5, "safe_time_sweep_batch": 50}
    ids = _seed(store, 50, store.now() - timedelta(seconds=1), prefix="before")

    # 1. killed between claim and publish: nothing published, rows claimed.
    hung = _sweeper(processes, "hung-before", env_for(conf, DELAYS_TEST_HANG_BEFORE_PUBLISH="1"))
    wait_for(lambda: redis_client.get("test:hung") == b"before", timeout=60, message="sweeper hung")
    hung.kill()
    assert redis_client.llen("celery") == 0
    assert store.counts()[C.STATUS_CLAIMED] == 50
    # In this process, right away: the claim timeout has not passed, nothing is taken back or sent.
    app = make_app("killed", **conf)
    define_tasks(app)
    stats = sweep(app)
    assert stats.reclaimed == 0
    assert stats.sent == 0
    assert store.counts()[C.STATUS_CLAIMED] == 50
    time.sleep(5.5)
    again = processes.cli(DELAYS_APP, "safe-time", "sweep", env=env_for(conf))
    stats = json.loads(again.stdout)
    assert stats["reclaimed"] == 50
    assert stats["sent"] == 50
    assert sorted(_queued_ids(redis_client)) == ids

    # 2. killed after publishing, before marking sent: republished, the delivery record runs each once.
    redis_client.delete("celery", "test:hung")
    ids2 = _seed(store, 20, store.now() - timedelta(seconds=1), prefix="after")
    hung = _sweeper(processes, "hung-after", env_for(conf, DELAYS_TEST_HANG_AFTER_PUBLISH="1"))
    wait_for(lambda: redis_client.get("test:hung") == b"after", timeout=60, message="sweeper hung")
    hung.kill()
    first = _queued_ids(redis_client)
    assert sorted(first) == ids2  # the whole batch went out in one round trip
    time.sleep(5.5)
    again = processes.cli(DELAYS_APP, "safe-time", "sweep", env=env_for(conf))
    assert json.loads(again.stdout)["sent"] == 20, again.stderr
    queued = _queued_ids(redis_client)
    assert len(queued) == 40
    assert sorted(set(queued)) == ids2
    worker = processes.worker(DELAYS_APP, name="checked", env=env_for(conf))
    wait_for(lambda: len(runs(redis_client)) >= 20, timeout=60, message="20 runs")
    worker.wait_for_log("skipping a stale delivery of stored task|is running on", timeout=30)
    time.sleep(1)
    done = [r["task_id"] for r in runs(redis_client)]
    assert sorted(done) == ids2
    store.close()


def test_due_decision_uses_the_database_clock(
    processes: ProcessManager, postgres_url: str, redis_client: redis.Redis
) -> None:
    store = fresh_sql_store(postgres_url)
    now = store.now()
    due_now = _seed(store, 3, now - timedelta(seconds=1), prefix="due")
    not_yet = _seed(store, 3, now + timedelta(seconds=120), prefix="later")
    env = env_for({"safe_time_store_url": postgres_url}, SAFE_TIME_LOCAL_CLOCK_SKEW="300")
    result = processes.cli(DELAYS_APP, "safe-time", "sweep", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["sent"] == 3
    messages = [json.loads(raw) for raw in redis_client.lrange("celery", 0, -1)]
    assert sorted(m["headers"]["id"] for m in messages) == due_now
    for message in messages:
        row = store.get(message["headers"]["id"])
        assert row is not None
        # Published for the same instant the row was due: eta is due_at, not the skewed local now.
        assert datetime.fromisoformat(message["headers"]["eta"]) == row.due_at
    assert all(store.get(i).status == C.STATUS_PENDING for i in not_yet)  # type: ignore[union-attr]
    store.close()


def test_operator_commands_and_status_section(
    processes: ProcessManager, postgres_url: str, make_app: Callable[..., Celery]
) -> None:
    store = fresh_sql_store(postgres_url)
    store.insert(new_delay("s1", store.now() + timedelta(hours=1)))
    store.insert(new_delay("s2", store.now() - timedelta(seconds=30)))
    env = env_for({"safe_time_store_url": postgres_url})
    out = processes.cli(DELAYS_APP, "safe-time", "status", "--json", env=env)
    assert out.returncode == 0, out.stderr
    section = json.loads(out.stdout)["delays"]
    assert section["pending"] == 2
    assert section["lateness_seconds"] >= 29
    listing = processes.cli(DELAYS_APP, "safe-time", "delays", "list", "--json", "--status", "pending", env=env)
    assert [r["id"] for r in json.loads(listing.stdout)] == ["s2", "s1"]
    shown = processes.cli(DELAYS_APP, "safe-time", "delays", "show", "s1", env=env)
    assert json.loads(shown.stdout)["call"]["args"] == ["s1"]
    assert processes.cli(DELAYS_APP, "safe-time", "delays", "show", "nope", env=env).returncode == 1
    moved = processes.cli(DELAYS_APP, "safe-time", "delays", "reschedule", "s1", "--countdown", "7200", env=env)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert store.get("s1").due_at - store.now() > timedelta(seconds=7100)  # type: ignore[union-attr]
    gone = processes.cli(DELAYS_APP, "safe-time", "delays", "cancel", "s1", env=env)
    assert gone.returncode == 0
    assert processes.cli(DELAYS_APP, "safe-time", "delays", "cancel", "s1", env=env).returncode == 1
    assert store.get("s1").status == C.STATUS_CANCELLED  # type: ignore[union-attr]
    store.close()


def test_purge_command_deletes_old_finished_rows_in_batches(processes: ProcessManager, postgres_url: str) -> None:
    store = fresh_sql_store(postgres_url)
    past = store.now() - timedelta(seconds=1)
    for i in range(5):
        store.insert(new_delay(f"done{i}", past))
    store.insert(new_delay("broken", past))
    store.insert(new_delay("claimed", past))
    claimed = store.claim_due(limit=10, lookahead=0, token="t")
    assert len(claimed) == 7
    assert store.mark_sent([f"done{i}" for i in range(5)], "t") == 5
    assert store.mark_failed("broken", "t", "boom")
    store.insert(new_delay("later", store.now() + timedelta(hours=1)))
    store.insert(new_delay("gone", store.now() + timedelta(hours=1)))
    assert store.cancel("gone")
    eight_days_ago = store.now() - timedelta(days=8)
    with store.engine.begin() as conn:
        conn.execute(sa.update(delays).values(updated_at=eight_days_ago))
    store.insert(new_delay("fresh", past))
    assert len(store.claim_due(limit=10, lookahead=0, token="u")) == 1
    assert store.mark_sent(["fresh"], "u") == 1
    env = env_for({"safe_time_store_url": postgres_url})

    def purge(*args: str) -> Any:
        out = processes.cli(DELAYS_APP, "safe-time", "delays", "purge", *args, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    dry = json.loads(purge("--older-than", "7d", "--dry-run", "--json").stdout)
    assert dry["matched"] == 6
    assert dry["dry_run"] is True
    assert store.counts()[C.STATUS_SENT] == 6
    assert "6 row(s) deleted" in purge("--older-than", "7d").stdout
    assert {r.id for r in store.list()} == {"broken", "claimed", "later", "fresh"}
    # failed rows only when named; pending and claimed ones never.
    done = json.loads(purge("--older-than", "604800", "--status", "failed", "--json").stdout)
    assert done["deleted"] == 1
    assert done["statuses"] == ["failed"]
    assert "0 row(s) deleted" in purge("--older-than", "12h").stdout
    assert {r.id for r in store.list()} == {"claimed", "later", "fresh"}
    refused = processes.cli(
        DELAYS_APP, "safe-time", "delays", "purge", "--older-than", "1d", "--status", "sent,pending", env=env
    )
    assert refused.returncode == 2
    assert "sent,pending" in refused.stderr
    bad = processes.cli(DELAYS_APP, "safe-time", "delays", "purge", "--older-than", "7x", env=env)
    assert bad.returncode == 2
    assert "is not a duration" in bad.stderr
    store.close()


def test_store_down_requeues_the_delivery_instead_of_running_it(
    processes: ProcessManager,
    postgres_url: str,
    redis_client: redis.Redis,
    make_app: Callable[..., Celery],
) -> None:
    """The delivery record fails closed: with the store unreachable from the worker a stored task is
    re-queued (same id, same retry count, same delivery token), runs once when the store is back, and
    a later copy of the same delivery is dropped."""
    store = fresh_sql_store(postgres_url)
    proxy, proxied_url = proxy_for(postgres_url)
    try:
        worker = processes.worker(DELAYS_APP, name="w", env=env_for({"safe_time_store_url": proxied_url}))
        worker.wait_for_log(r"ready\.", timeout=90)
        ids = _seed(store, 3, store.now() - timedelta(seconds=1), prefix="unchecked")
        proxy.cut()
        app = test_app(make_app, safe_time_store_url=postgres_url)
        assert sweep(app).sent == 3
        worker.wait_for_log(r"delivery record unavailable for stored task .* re-queued in", timeout=60)
        time.sleep(2)
        assert runs(redis_client) == []
        proxy.restore()
        wait_for(lambda: len(runs(redis_client)) >= 3, timeout=90, message="3 runs after the store returned")
        # A second copy of one of them (a re-publish after a crash window) is dropped, not run.
        first = store.get(ids[0])
        assert first is not None
        assert first.delivery_token
        assert (first.status, first.outcome) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED)
        headers = {C.HEADER_STORED: first.due_at.isoformat(), C.HEADER_DELIVERY: first.delivery_token}
        app.send_task(first.task, args=[ids[0]], task_id=ids[0], headers=headers)
        worker.wait_for_log("skipping a stale delivery of stored task", timeout=60)
        time.sleep(1)
        assert sorted(r["task_id"] for r in runs(redis_client)) == ids
    finally:
        proxy.close()
        store.close()


def test_an_end_recorded_after_a_store_outage_longer_than_the_claim_timeout_runs_once(
    processes: ProcessManager,
    postgres_url: str,
    redis_client: redis.Redis,
    make_app: Callable[..., Celery],
) -> None:
    """Soak seed 220364 (CI, 2 December): an acks_late stored task ended while the store was down for
    ~30 s. The worker stopped trying to record the end (and its heartbeat) after the claim timeout,
    so once the store was back the sweep found the heartbeat stale and ran the task again, though its
    worker was alive and knew it had ended. Now it keeps trying for as long as an outage plausibly
    lasts: the sweep, back with the store, sees the heartbeat again, then the end; one run."""
    lock_ttl = 3.0
    conf = {"safe_time_lock_ttl": lock_ttl, "safe_time_claim_timeout": 2}
    store = fresh_sql_store(postgres_url)
    proxy, proxied_url = proxy_for(postgres_url)
    try:
        worker = processes.worker(DELAYS_APP, name="w", env=env_for({**conf, "safe_time_store_url": proxied_url}))
        worker.wait_for_log(r"ready\.", timeout=90)
        payload = json.dumps({"args": ["outage", 2.0], "kwargs": {}, "options": {}}).encode()
        store.bulk_insert(
            [new_delay("outage-1", store.now() - timedelta(seconds=1), task="tests.delays.slow", payload=payload)]
        )
        # The sweeps go to the database directly, and only while the worker's store is up: a sweeper
        # shares the database with the workers, and loses it with them.
        app = test_app(make_app, safe_time_store_url=postgres_url, **conf)
        assert sweep(app).sent == 1
        wait_for(lambda: runs(redis_client), timeout=60, message="the run to start")
        proxy.cut()
        worker.wait_for_log(r"the store is unreachable, recording it in the background", timeout=30)
        time.sleep(2 + lock_ttl / 2 + 4)  # past the claim timeout and the in-line retries
        proxy.restore()
        sweep(app)  # the first look at a stale heartbeat only suspects it
        time.sleep(lock_ttl + 2)
        sweep(app)  # a run whose heartbeat stayed stale since would be run again here
        time.sleep(3)
        assert [r["label"] for r in runs(redis_client)] == ["outage"]
        row = finished_row(store, "outage-1")
        assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 1)
    finally:
        proxy.close()
        store.close()


def test_a_run_suspected_between_two_store_outages_is_not_run_again(
    processes: ProcessManager,
    postgres_url: str,
    redis_client: redis.Redis,
    make_app: Callable[..., Celery],
) -> None:
    """Soak seed 117620 (amqp): a stored run started as the database went down; it came back for about
    a second, long enough for a sweep to find the heartbeat stale and suspect the run, then went
    down again for longer than the lock ttl. The first sweep after that took the run over and ran it
    again, though its worker was alive and still trying to record its end: the suspicion had
    counted time in which no heartbeat could be written. Now that sweep suspects the run anew, and
    the worker's end lands while the store answers; one run."""
    lock_ttl = 3.0
    # Sweeps every second: a look more than 2 s after the previous one starts the suspicion over.
    conf = {"safe_time_lock_ttl": lock_ttl, "safe_time_sweep_interval": 1}
    store = fresh_sql_store(postgres_url)
    proxy, proxied_url = proxy_for(postgres_url)
    try:
        worker = processes.worker(DELAYS_APP, name="w", env=env_for({**conf, "safe_time_store_url": proxied_url}))
        worker.wait_for_log(r"ready\.", timeout=90)
        payload = json.dumps({"args": ["twice-cut", 1.0], "kwargs": {}, "options": {}}).encode()
        store.bulk_insert(
            [new_delay("twice-cut-1", store.now() - timedelta(seconds=1), task="tests.delays.slow", payload=payload)]
        )
        # The sweeps go to the database directly, and only while the store is up for everyone.
        app = test_app(make_app, safe_time_store_url=postgres_url, **conf)
        assert sweep(app).sent == 1
        wait_for(lambda: runs(redis_client), timeout=60, message="the run to start")
        proxy.cut()
        worker.wait_for_log(r"the store is unreachable, recording it in the background", timeout=30)
        started = store.get("twice-cut-1")
        assert started is not None
        assert started.heartbeat_at is not None
        # The short recovery: a sweep finds the heartbeat stale and suspects the run (the worker's
        # writes do not land in it).
        time.sleep(max(0.0, lock_ttl + 0.5 - (store.now() - started.heartbeat_at).total_seconds()))
        assert sweep(app).rerun == 0
        suspected = store.get("twice-cut-1")
        assert suspected is not None
        assert suspected.suspected_at is not None
        # Down again for longer than the lock ttl: nobody looks, nothing is written.
        time.sleep(lock_ttl + 2)
        proxy.restore()
        assert sweep(app).rerun == 0  # suspected anew: the outage does not count as silence

        def ended() -> bool:
            sweep(app)
            row = store.get("twice-cut-1")
            return row is not None and row.status != C.STATUS_STARTED

        wait_for(ended, timeout=lock_ttl * 3, interval=0.3, message="the run's end to be recorded")
        assert [r["label"] for r in runs(redis_client)] == ["twice-cut"]
        row = finished_row(store, "twice-cut-1")
        assert (row.status, row.outcome, row.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 1)
    finally:
        proxy.close()
        store.close()
