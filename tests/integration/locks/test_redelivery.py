"""Issue 13, locks: a redelivered copy is re-queued (never dropped), a finished delivery is
recognised, and a lost reply to the acquire script is recognised as our own. Real workers, real
brokers (Redis, RabbitMQ and the local SQS endpoint), a real kill -9 of the whole worker process group."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from celery_safe_time.redis_client import load_script
from tests.helpers import locks as h
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration


def _holder(workers: dict[str, CeleryProcess], start: dict[str, object]) -> CeleryProcess:
    hostname = str(start["hostname"])
    return workers[hostname.split("@", 1)[0]]


@pytest.mark.parametrize(
    ("broker_url", "coordination_conf"),
    [("redis", "redis"), ("amqp", "redis"), ("amqp", "postgres"), ("amqp", "postgres-session"), ("sqs", "redis")],
    indirect=True,
)
def test_killed_acks_late_holder_runs_again_once_its_lock_expires(
    processes: ProcessManager,
    broker_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    coordination_conf: dict[str, Any],
) -> None:
    """Item 1. On main the redelivered copy found the dead run's lock with its own identity, was
    answered "duplicate" and acked by ``Ignore``: the task never ran again. Now the copy is
    re-queued until the dead holder's lock expires, then runs (on_conflict="skip" does not skip it).

    On PostgreSQL (RabbitMQ broker, no Redis setting): lease rows behave as Redis does; a session
    advisory lock is freed by the server when the killed holder's connection closes, so the copy
    runs as soon as it is redelivered, still never beside the dead run and still exactly once."""
    ttl = 10.0
    session = coordination_conf.get("safe_time_coordination_locks") == "session"
    env = h.broker_env(broker_url, redis_url, visibility_timeout=4, coordination=coordination_conf)
    workers = {
        name: h.start_worker(processes, name=name, ttl=ttl, retry_after=0.5, concurrency=2, env=env)
        for name in ("a", "b")
    }
    client = h.client_app(redis_url, broker_url)
    try:
        result = client.send_task("locks.durable", args=("k", 2.0))
        [first] = wait_for(lambda: h.starts(redis_client), 30, message="the first run to start")
        holder = _holder(workers, first)
        holder.kill()  # os.killpg(SIGKILL): the main process and its pool children, mid-run
        killed = time.time()
        assert killed - first["started"] < ttl / 3, "killed before the first renewal"

        assert result.get(timeout=ttl + 30) == "ran"
        starts = h.starts(redis_client)
        assert len(starts) == 2, starts
        survivor = next(w for w in workers.values() if w is not holder)
        assert starts[1]["hostname"].startswith(survivor.name + "@")
        # the copy ran after the holder was dead: never two holders at once
        assert starts[1]["started"] >= killed
        if not session:
            # ... and waited for the dead holder's lease to expire
            assert starts[1]["started"] >= first["started"] + ttl - 0.5
        [run] = h.runs(redis_client, "durable")
        assert run["task_id"] == result.id
        actions = [s["action"] for s in h.signals(redis_client, "overlap_conflict") if s["task_id"] == result.id]
        if not session:
            assert "duplicate" in actions, "the redelivered copy must have met its own delivery's lock"
        # the waits were re-queues, counted in their own header, not retries against max_retries
        assert run["retries"] == 0
        assert (run["requeues"] or 0) == actions.count("duplicate")
        assert "skip" not in actions
        assert "finished" not in actions
    finally:
        client.close()


@pytest.mark.parametrize("broker_url", ["redis", "sqs"], indirect=True)
def test_redelivery_while_running_is_requeued_then_dropped_when_the_holder_finishes(
    processes: ProcessManager, broker_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """Redis and SQS hand out again a message still running after ``visibility_timeout``: the copy
    is re-queued while the holder runs and dropped once it finished (its identity is remembered)."""
    env = h.broker_env(broker_url, redis_url, visibility_timeout=2)
    worker = h.start_worker(processes, ttl=3.0, retry_after=0.5, concurrency=4, env=env)
    client = h.client_app(redis_url, broker_url)
    try:
        result = client.send_task("locks.durable", args=("r", 6.0))
        assert result.get(timeout=40) == "ran"
        finished = wait_for(
            lambda: [s for s in h.signals(redis_client, "overlap_conflict") if s["action"] == "finished"],
            20,
            message="the redelivered copy to be dropped as finished",
        )
        assert finished[0]["task_id"] == result.id
        duplicates = [s for s in h.signals(redis_client, "overlap_conflict") if s["action"] == "duplicate"]
        assert duplicates, "the copy arrived while the holder ran and was re-queued"
        assert all(s["at"] < finished[0]["at"] for s in duplicates)
        time.sleep(1.0)
        assert len(h.starts(redis_client)) == 1, "the body ran exactly once"
        assert [r["task_id"] for r in h.runs(redis_client, "durable")] == [result.id]
        assert "dropping a redelivered copy of " + result.id in worker.log()
        marker = redis_client.keys("safe_time:lock-done:durable:r:*")
        assert len(marker) == 1
        assert redis_client.ttl(marker[0]) > 3000, "kept at least an hour (and past visibility_timeout)"
    finally:
        client.close()


@pytest.fixture
def acquire_sha(redis_client: redis.Redis) -> str:
    source = load_script("celery_safe_time.locks", "acquire")
    # Loaded beforehand, so the first EVALSHA runs the script instead of answering NOSCRIPT.
    sha = str(redis_client.script_load(source))
    assert sha == hashlib.sha1(source.encode()).hexdigest()
    return sha


@pytest.fixture
def dropper(request: pytest.FixtureRequest, redis_url: str, acquire_sha: str) -> Iterator[h.ReplyDropper]:
    parts = urlsplit(redis_url)
    proxy = h.ReplyDropper((parts.hostname or "127.0.0.1", parts.port or 6379), acquire_sha.encode(), request.param)
    yield proxy
    proxy.close()


@pytest.mark.parametrize(
    "dropper",
    [
        pytest.param(1, id="redis-py-resends"),
        pytest.param(11, id="requeued-copy"),
    ],
    indirect=True,
)
def test_lost_acquire_reply_is_recognised_as_our_own(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis, dropper: h.ReplyDropper
) -> None:
    """Item 4. The acquire script ran and set the lock, but its reply was lost (the connection
    closed before it arrived). One loss: redis-py re-sends the script, which finds the lock its own
    first try set (on main: "duplicate", dropped by Ignore). Eleven losses: redis-py gives up, the
    task is re-queued carrying the token, and the copy finds the orphaned lock (on main: "held" by
    a different identity, and on_conflict="skip" skipped the task's only run). Now both take the
    orphaned lock over, with the fence it was given, and run once."""
    db = int(urlsplit(redis_url).path.strip("/") or 0)
    env = h.broker_env(redis_url, redis_url, safe_time_redis_url=dropper.url(db))
    h.start_worker(processes, concurrency=2, env=env)
    client = h.client_app(redis_url)
    try:
        result = client.send_task("locks.once_skip", args=("x",))
        # When redis-py does not re-send within the call, each lost reply is one outage re-queue, and
        # their back-offs grow ~1.5x from 0.5 s (C.LOCK_REDIS_DOWN_BACKOFF_*): eleven of them wait
        # ~57 s in all, so 60 s was the product's own worst case (seen failing under load).
        assert result.get(timeout=180) == "ran"
        assert dropper.dropped == dropper.drops, "every planned reply was lost"
        [run] = h.runs(redis_client, "once_skip")
        assert run["task_id"] == result.id
        # taken over, not taken anew: the fence is the one the lost reply carried
        assert redis_client.get("safe_time:lock-fence:once:x") == str(run["fence"]).encode()
        actions = [s["action"] for s in h.signals(redis_client, "overlap_conflict")]
        assert actions == []
        # The release is written as the body returns and goes through the proxy, while the result
        # reaches the result backend directly: it may land a moment after the result is read.
        wait_for(lambda: not redis_client.exists("safe_time:lock:once:x"), 10, interval=0.05, message="the release")
    finally:
        client.close()
