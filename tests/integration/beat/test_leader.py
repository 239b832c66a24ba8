"""Safe Beat with real ``celery beat`` processes: one leader, failover, paused leader, shared state."""

from __future__ import annotations

import itertools
import json
import time
from datetime import datetime
from typing import Any

import pytest
import redis

from tests.helpers import services
from tests.helpers.beat import BEAT_APP, beat_env, duplicates, holder_pid, runs, settle
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
SCHEDULE = {
    "fast": {"task": "tests.record", "every": 1, "args": ["fast"]},
    "five": {"task": "tests.record", "every": 5, "args": ["five"]},
}


def _slot(run: dict[str, object]) -> float:
    headers = run["headers"]
    assert isinstance(headers, dict)
    return datetime.fromisoformat(str(headers["safe_time_slot"])).timestamp()


def _epochs(client: redis.Redis) -> set[int]:
    return {int(r["headers"]["safe_time_epoch"]) for r in runs(client)}


def _start(
    processes: ProcessManager, n: int, schedule: dict[str, object], broker: dict[str, str] | None = None, **conf: object
) -> list[CeleryProcess]:
    env = {**beat_env(schedule, safe_time_beat_lease=LEASE, **conf), **(broker or {})}
    if broker and "SAFE_TIME_TEST_APP_CONF" in broker:  # the broker's settings and the coordination's together
        env["SAFE_TIME_TEST_APP_CONF"] = json.dumps({**json.loads(broker["SAFE_TIME_TEST_APP_CONF"]), **conf})
    processes.worker(BEAT_APP, env=env, name="worker")
    return [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(n)]


def _leader(
    client: redis.Redis, beats: list[CeleryProcess], coordination: dict[str, Any] | None = None
) -> CeleryProcess:
    pid = wait_for(lambda: holder_pid(client, coordination or {}), 30, message="a leader")
    return next(b for b in beats if b.pid == pid)


def _assert_contiguous(client: redis.Redis, label: str, step: float) -> list[float]:
    slots = sorted(_slot(r) for r in runs(client, label))
    gaps = [b - a for a, b in itertools.pairwise(slots)]
    assert all(g == pytest.approx(step) for g in gaps), f"{label} slots not contiguous: {gaps}"
    return slots


def test_one_leader_three_beats(processes: ProcessManager, redis_client: redis.Redis) -> None:
    _one_leader(processes, redis_client, minutes=1)


@pytest.mark.slow
def test_one_leader_three_beats_for_minutes(processes: ProcessManager, redis_client: redis.Redis) -> None:
    _one_leader(processes, redis_client, minutes=4)


def _one_leader(processes: ProcessManager, redis_client: redis.Redis, minutes: int) -> None:
    schedule = {**SCHEDULE, "minutely": {"task": "tests.record", "cron": {"minute": "*"}, "args": ["minutely"]}}
    beats = _start(processes, 3, schedule)
    # The first minute boundary may come seconds after start: also wait for enough fast slots.
    wait_for(
        lambda: len(runs(redis_client, "minutely")) >= minutes and len(runs(redis_client, "fast")) >= 12,
        60 * minutes + 60,
        interval=1,
        message="minutely and fast runs",
    )
    time.sleep(3)
    # Counted before shutdown: terminating the leader first hands the lease to a standby (by design).
    acquired = sum("acquired the leader lease" in b.log() for b in beats)
    leader = _leader(redis_client, beats)
    # The standbys first, the leader last: a standby still running when the leader releases the lease
    # rightly takes it (a second epoch, published by design), which is not what this test looks at.
    for beat in [b for b in beats if b is not leader] + [leader]:
        assert beat.alive()
        beat.terminate()
    settle(redis_client)
    assert duplicates(redis_client) == {}
    assert len(_epochs(redis_client)) == 1, "more than one leader published"
    fast = _assert_contiguous(redis_client, "fast", 1.0)
    assert len(fast) >= 10
    _assert_contiguous(redis_client, "five", 5.0)
    minutely = [_slot(r) for r in runs(redis_client, "minutely")]
    assert all(s % 60 == 0 for s in minutely)
    assert acquired == 1


def _on_broker(broker_url: str, redis_url: str) -> dict[str, str]:
    """Env for beats and worker publishing to ``broker_url``; lease, results and run records stay on Redis."""
    if broker_url == redis_url:
        return {}
    conf = {
        "safe_time_beat_lease": LEASE,
        "safe_time_redis_url": redis_url,
        "result_backend": redis_url,
        **services.broker_conf(broker_url),
    }
    return {
        "SAFE_TIME_TEST_BROKER_URL": broker_url,
        "SAFE_TIME_TEST_RECORD_URL": redis_url,
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }


@pytest.mark.parametrize("broker_url", ["redis", "amqp", "sqs"], indirect=True)
def test_failover_after_kill_9_keeps_the_grid(
    processes: ProcessManager, redis_client: redis.Redis, broker_url: str, redis_url: str
) -> None:
    """On Redis, RabbitMQ and SQS: the beats publish to the broker, the lease and slot guard live in Redis."""
    beats = _start(processes, 2, SCHEDULE, broker=_on_broker(broker_url, redis_url))
    leader = _leader(redis_client, beats)
    wait_for(lambda: len(runs(redis_client, "five")) >= 2, 30, message="two 'five' runs")
    old_epochs = _epochs(redis_client)
    killed_at = time.time()
    leader.kill()
    standby = next(b for b in beats if b is not leader)

    def new_epoch_run() -> dict[str, object] | None:
        fresh = [r for r in runs(redis_client) if int(r["headers"]["safe_time_epoch"]) not in old_epochs]
        return fresh[0] if fresh else None

    first = wait_for(new_epoch_run, 30, message="a run from the new leader")
    # within lease + lease/3 (plus a little for the worker to pick the message up)
    assert float(first["started"]) - killed_at <= LEASE + LEASE / 3 + 3.0
    time.sleep(6)
    standby.terminate()
    settle(redis_client)
    assert duplicates(redis_client) == {}
    # shared state: the new leader continues the same 5 s grid, never early, never repeating a slot
    five = sorted(_slot(r) for r in runs(redis_client, "five"))
    assert all((b - a) % 5 == 0 and b > a for a, b in itertools.pairwise(five))
    # the fast entry lost at most the slots of the failover window (run_once: one catch-up)
    fast = sorted(_slot(r) for r in runs(redis_client, "fast"))
    assert max(b - a for a, b in itertools.pairwise(fast)) <= LEASE + LEASE / 3 + 2


def test_sigterm_hands_over_within_one_poll(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    beats = _start(processes, 2, SCHEDULE, **coordination)
    leader = _leader(redis_client, beats, coordination)
    wait_for(lambda: runs(redis_client, "fast"), 30, message="a first run")
    old = _epochs(redis_client)
    stopped_at = time.time()
    assert leader.terminate() is not None
    assert "released the leader lease" in leader.log()
    standby = next(b for b in beats if b is not leader)
    standby.wait_for_log("acquired the leader lease", 30)

    def takeover() -> float | None:
        fresh = [r for r in runs(redis_client) if int(r["headers"]["safe_time_epoch"]) not in old]
        return float(fresh[0]["started"]) if fresh else None

    started = wait_for(takeover, 30, message="a run from the new leader")
    assert started - stopped_at <= LEASE / 3 + 3.0
    standby.terminate()
    settle(redis_client)
    assert duplicates(redis_client) == {}


def test_paused_leader_resumes_as_standby(
    processes: ProcessManager, redis_client: redis.Redis, broker_url: str, redis_url: str, coordination: dict[str, Any]
) -> None:
    """On Redis and on RabbitMQ, with Redis and PostgreSQL coordination: the woken leader's publishes
    are refused before they reach the broker."""
    beats = _start(processes, 2, SCHEDULE, broker=_on_broker(broker_url, redis_url), **coordination)
    leader = _leader(redis_client, beats, coordination)
    wait_for(lambda: len(runs(redis_client, "fast")) >= 3, 30, message="runs")
    leader.pause()
    standby = next(b for b in beats if b is not leader)
    standby.wait_for_log("acquired the leader lease", 30)
    time.sleep(2)
    resumed_at = time.time()
    leader.resume()
    leader.wait_for_log("lost the leader lease", 30)
    time.sleep(4)
    assert leader.alive()
    assert standby.alive()
    assert holder_pid(redis_client, coordination) == standby.pid
    # The woken (standby) beat first: stopping the leader first releases the lease, and the woken beat,
    # still running, rightly takes it (a new epoch) before it is stopped in turn.
    for beat in (leader, standby):
        beat.terminate()
    settle(redis_client)
    assert duplicates(redis_client) == {}
    # Slots after the resume, by slot time: a worker's backlog may start an old leader's earlier slot
    # late, which says nothing about who published after the resume.
    late = [r for r in runs(redis_client) if _slot(r) > resumed_at + 1]
    assert late
    assert len({r["headers"]["safe_time_epoch"] for r in late}) == 1, "the resumed leader published"
