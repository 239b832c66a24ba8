"""``overlap_lock`` and ``idempotent`` on real workers (prefork, concurrency 8) and real Redis; the
exclusion and kill -9 tests also with the locks on PostgreSQL (``coordination_conf``)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time.locks.backends import get_lock_backend
from tests.helpers import locks as h
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def client_app(redis_url: str) -> Iterator[Celery]:
    app = h.client_app(redis_url)
    yield app
    app.close()


BROKER_AND_COORDINATION = pytest.mark.parametrize(
    ("broker_url", "coordination_conf"),
    [("redis", "redis"), ("amqp", "redis"), ("amqp", "postgres"), ("amqp", "postgres-session")],
    indirect=True,
)


@BROKER_AND_COORDINATION
def test_per_key_exclusion_with_retry(
    processes: ProcessManager,
    redis_client: redis.Redis,
    broker_url: str,
    redis_url: str,
    coordination_conf: dict[str, Any],
) -> None:
    """On Redis and on RabbitMQ: conflicting runs are re-queued (countdowns through the broker).
    Locks on Redis, or on PostgreSQL (lease rows, session advisory locks) with no Redis setting."""
    env = h.broker_env(broker_url, redis_url, coordination=coordination_conf)
    h.start_worker(processes, ttl=3.0, retry_after=0.3, env=env)
    client_app = h.client_app(redis_url, broker_url)
    results = [client_app.send_task("locks.sync", args=(account, 2.0)) for _ in range(10) for account in (1, 2)]

    done = h.wait_runs(redis_client, "sync", 20, timeout=150)
    assert sorted(r.get(timeout=30) for r in results) == [1] * 10 + [2] * 10

    by_account = {a: [(r["started"], r["finished"]) for r in done if r["key"] == a] for a in (1, 2)}
    assert len(by_account[1]) == len(by_account[2]) == 10
    for account, intervals in by_account.items():
        assert h.overlaps(intervals) == [], f"account {account} ran twice at once"
    # the two accounts did run side by side
    side_by_side = [(a, b) for a in by_account[1] for b in by_account[2] if a[0] < b[1] and b[0] < a[1]]
    assert len(side_by_side) >= 5
    # each account's fencing numbers strictly increase in start order
    for account in (1, 2):
        fences = [r["fence"] for r in sorted((r for r in done if r["key"] == account), key=lambda r: r["started"])]
        assert fences == sorted(fences)
        assert len(set(fences)) == 10
    assert h.signals(redis_client, "overlap_conflict"), "the busy account must have hit conflicts"
    assert all(s["action"] == "retry" for s in h.signals(redis_client, "overlap_conflict"))
    client_app.close()


def _exists(client: redis.Redis, key: str) -> bool:
    return bool(client.exists(f"safe_time:lock:{key}"))


def _started(client: redis.Redis, label: str, timeout: float = 30.0) -> float:
    value = wait_for(lambda: client.get(f"test:locks:started:{label}"), timeout, message=f"{label} started")
    return float(value)


def test_long_task_keeps_its_lock_through_renewals(
    processes: ProcessManager, client_app: Celery, redis_client: redis.Redis
) -> None:
    ttl = 1.5
    h.start_worker(processes, ttl=ttl)
    owner = client_app.send_task("locks.hold", args=("long", 3 * ttl))
    _started(redis_client, owner.id)
    first = h.lock_fields(redis_client, "hold:long")
    assert first["task_id"] == owner.id

    renewed_at = {first["renewed_at"]}
    competitors = []
    while not owner.ready():
        # the lock is there the whole time, never expired in between
        fields = h.lock_fields(redis_client, "hold:long")
        if owner.ready():
            break
        assert fields.get("task_id") == owner.id, "the lock must not lapse while its task runs"
        assert fields["fence"] == first["fence"]
        renewed_at.add(fields["renewed_at"])
        if len(competitors) < 8:
            competitors.append(client_app.send_task("locks.hold", args=("long", 0.1)))
        time.sleep(0.25)

    assert owner.get(timeout=10) == "finished"
    assert [c.get(timeout=30) for c in competitors] == [None] * len(competitors)
    assert len(h.runs(redis_client, "hold")) == 1, "no second run may start while the first holds the key"
    assert len(renewed_at) >= 3, f"expected several renewals at ttl/3, saw {sorted(renewed_at)}"
    skipped = [s for s in h.signals(redis_client, "overlap_conflict") if s["action"] == "skip"]
    assert len(skipped) == len(competitors)
    assert not _exists(redis_client, "hold:long")


def test_kill_9_frees_the_key_within_ttl(
    processes: ProcessManager,
    client_app: Celery,
    redis_client: redis.Redis,
    redis_url: str,
    coordination_conf: dict[str, Any],
    make_app: Callable[..., Celery],
) -> None:
    """Redis and PostgreSQL lease rows: the lock expires ``ttl`` after the kill. A PostgreSQL session
    advisory lock is freed by the server as soon as the killed child's connection closes."""
    ttl = 2.0
    env = h.broker_env(redis_url, redis_url, coordination=coordination_conf)
    store = get_lock_backend(make_app(**coordination_conf))
    worker = h.start_worker(processes, ttl=ttl, concurrency=4, env=env)
    run = client_app.send_task("locks.hold", args=("crash", 60))
    _started(redis_client, run.id)
    [held] = store.scan("hold:crash")
    assert held.task_id == run.id
    killed = time.monotonic()
    worker.kill()
    wait_for(lambda: store.token_of("hold:crash") is None, ttl + 3, message="lock freed after kill -9")
    assert time.monotonic() - killed <= ttl + 1.0
    # the key is usable again: a fresh worker takes it with a higher fencing number
    h.start_worker(processes, name="after-crash", ttl=ttl, concurrency=4, env=env)
    again = client_app.send_task("locks.hold", args=("crash", 0.1))
    assert again.get(timeout=30) == "finished"
    # without acks_late the killed run is not redelivered (at most once): only the new run recorded
    assert [r["task_id"] for r in h.runs(redis_client, "hold")] == [again.id]
    assert held.fence is not None
    assert h.runs(redis_client, "hold")[0]["fence"] > held.fence
    if not coordination_conf:
        assert h.runs(redis_client, "hold")[0]["fence"] == int(redis_client.get("safe_time:lock-fence:hold:crash") or 0)


def test_paused_holder_loses_lock_and_cannot_touch_the_next_holders(
    processes: ProcessManager, client_app: Celery, redis_client: redis.Redis
) -> None:
    ttl = 1.5
    first_worker = h.start_worker(processes, name="first", ttl=ttl, concurrency=4)
    first = client_app.send_task("locks.hold", args=("pause", 30))
    _started(redis_client, first.id)
    first_fence = int(h.lock_fields(redis_client, "hold:pause")["fence"])
    first_worker.pause()
    wait_for(lambda: not _exists(redis_client, "hold:pause"), ttl + 3, message="paused holder's lock expiring")

    h.start_worker(processes, name="second", ttl=ttl, concurrency=4)
    second = client_app.send_task("locks.hold", args=("pause", 8))
    _started(redis_client, second.id)
    first_worker.resume()

    # the resumed holder is told (LockLost inside the body) instead of running on
    lost_run = h.wait_runs(redis_client, "hold", 1, timeout=30)[0]
    assert lost_run["task_id"] == first.id
    assert lost_run["outcome"] == "lost"
    first.get(timeout=30, propagate=False)
    assert first.state == "FAILURE"
    assert "LockLost" in repr(first.result)
    assert [s["task_id"] for s in h.signals(redis_client, "overlap_lock_lost")] == [first.id]
    # and its release (compare-and-delete on its own token) left the new holder's lock alone
    fields = h.lock_fields(redis_client, "hold:pause")
    assert fields["task_id"] == second.id
    assert int(fields["fence"]) > first_fence
    assert second.get(timeout=30) == "finished"


@pytest.mark.parametrize(
    ("mode", "options", "state"),
    [
        ("success", {}, "SUCCESS"),
        ("exception", {}, "FAILURE"),
        ("retry", {}, "RETRY"),
        ("ignore", {}, None),
        ("reject", {}, None),
        ("soft", {"soft_time_limit": 1, "time_limit": 20}, "FAILURE"),
    ],
)
def test_every_exit_path_releases(
    processes: ProcessManager,
    client_app: Celery,
    redis_client: redis.Redis,
    mode: str,
    options: dict[str, float],
    state: str | None,
) -> None:
    h.start_worker(processes, concurrency=4)
    result = client_app.send_task("locks.exit_path", args=(mode,), **options)
    _started(redis_client, mode)
    # the lock's ttl is 30 s: it is gone within seconds only because the run released it
    wait_for(lambda: not _exists(redis_client, f"exit:{mode}"), 10, message=f"release after {mode}")
    if state is not None:
        wait_for(lambda: result.state == state, 10, message=f"state {state}")
    if mode == "soft":
        assert redis_client.get("test:locks:soft:soft") == b"1"
        assert "SoftTimeLimitExceeded" in repr(result.result)


@pytest.mark.parametrize("mode", ["hard", "hard_stubborn"])
def test_hard_time_limit_releases(
    processes: ProcessManager, client_app: Celery, redis_client: redis.Redis, mode: str
) -> None:
    """The pool sends SIGTERM (SystemExit in the body: our ``finally`` releases), then SIGKILL
    0.1 s later. A body that survives the SIGTERM dies without running any ``finally``; then the
    worker's main process deletes the lock by the dead child's token."""
    worker = h.start_worker(processes, concurrency=4)
    result = client_app.send_task("locks.exit_path", args=(mode,), time_limit=2)
    started = _started(redis_client, mode)
    assert _exists(redis_client, f"exit:{mode}")
    wait_for(lambda: not _exists(redis_client, f"exit:{mode}"), 15, message="release after the hard time limit")
    # the lock's ttl is 30 s; it is gone right after the kill at ~2 s
    assert time.time() - started < 2 + 2
    if mode == "hard_stubborn":
        worker.wait_for_log(rf"released overlap lock 'exit:{mode}' of .* after its hard time limit killed", 10)
    else:
        worker.wait_for_log(rf"overlap lock 'exit:{mode}' of .* was already free after its hard time limit", 10)
    result.get(timeout=10, propagate=False)
    assert result.state == "FAILURE"
    assert "TimeLimitExceeded" in repr(result.result)


def test_conflict_policies(processes: ProcessManager, client_app: Celery, redis_client: redis.Redis) -> None:
    h.start_worker(processes, ttl=3.0)
    holder = client_app.send_task("locks.skipper", args=("c", 3.5))
    _started(redis_client, holder.id)

    skipped = client_app.send_task("locks.skipper", args=("c", 0))
    assert skipped.get(timeout=30) is None
    raised = client_app.send_task("locks.raiser", args=("c",))
    raised.get(timeout=30, propagate=False)
    assert raised.state == "FAILURE"
    assert "LockConflict" in repr(raised.result)
    retried = client_app.send_task("locks.retrier", args=("c",))

    assert holder.get(timeout=30) == "ran"
    assert retried.get(timeout=30) == "ran"
    assert [r["task_id"] for r in h.runs(redis_client, "skipper")] == [holder.id]
    assert h.runs(redis_client, "raiser") == []
    retrier_run = h.runs(redis_client, "retrier")[0]
    assert retrier_run["retries"] == 0, "waiting for a lock must not use up max_retries"

    by_action: dict[str, list[dict[str, object]]] = {}
    for s in h.signals(redis_client, "overlap_conflict"):
        by_action.setdefault(str(s["action"]), []).append(s)
    assert [s["task_id"] for s in by_action["skip"]] == [skipped.id]
    assert [s["task_id"] for s in by_action["raise"]] == [raised.id]
    retries = by_action["retry"]
    assert retries
    assert all(s["task_id"] == retried.id for s in retries)
    assert all(holder.id in str(s["holder"]) for s in by_action["skip"] + by_action["raise"] + retries)
    assert retrier_run["requeues"] == len(retries), "each re-queue is counted in a header instead"
    # re-queued after retry_after (1 s) plus up to 0.5 s jitter; the last one ran
    times = [float(str(s["at"])) for s in retries] + [retrier_run["started"]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(0.95 <= gap <= 1.5 + 1.0 for gap in gaps), gaps


def test_same_task_id_published_twice_is_two_messages(
    processes: ProcessManager, client_app: Celery, redis_client: redis.Redis
) -> None:
    """A second publish with a reused task id is a new message (its own ``safe_time_attempt``), not
    a redelivery: it waits for the lock and runs after the first (a true redelivery is
    ``test_redelivery.py``)."""
    h.start_worker(processes, ttl=3.0, retry_after=0.3)
    task_id = str(uuid.uuid4())
    first = client_app.send_task("locks.sync", args=(7, 1.0), task_id=task_id)
    _started(redis_client, task_id)
    client_app.send_task("locks.sync", args=(7, 1.0), task_id=task_id)
    done = h.wait_runs(redis_client, "sync", 2, timeout=30)
    assert first.get(timeout=30) == 7
    assert [r["task_id"] for r in done] == [task_id, task_id]
    assert h.overlaps([(r["started"], r["finished"]) for r in done]) == []
    actions = {s["action"] for s in h.signals(redis_client, "overlap_conflict")}
    assert actions == {"retry"}


@BROKER_AND_COORDINATION
def test_idempotent_runs_each_key_once(
    processes: ProcessManager,
    redis_client: redis.Redis,
    broker_url: str,
    redis_url: str,
    coordination_conf: dict[str, Any],
    make_app: Callable[..., Celery],
) -> None:
    """On Redis and on RabbitMQ: concurrent calls of a key in progress are re-queued, later ones skipped.
    Markers on Redis, or as PostgreSQL rows (no Redis setting)."""
    env = h.broker_env(broker_url, redis_url, coordination=coordination_conf)
    h.start_worker(processes, ttl=3.0, retry_after=0.3, env=env)
    client_app = h.client_app(redis_url, broker_url)
    keys = [(tenant, "2026-11") for tenant in range(10)]
    # 500 at once: many find another run of their key in progress and are re-queued
    for _ in range(50):
        for tenant, period in keys:
            client_app.send_task("locks.invoice", args=(tenant, period), kwargs={"seconds": 0.3})
    wait_for(lambda: len(h.signals(redis_client, "idempotent_skipped")) >= 490, 120, message="490 skips")
    # 500 more afterwards: every one finds its key recorded
    for _ in range(50):
        for tenant, period in keys:
            client_app.send_task("locks.invoice", args=(tenant, period))
    wait_for(lambda: len(h.signals(redis_client, "idempotent_skipped")) >= 990, 120, message="990 skips")
    time.sleep(1.0)
    sent = h.runs(redis_client, "invoice")
    assert len(sent) == 10
    assert sorted(r["key"] for r in sent) == sorted(f"{t}:{p}" for t, p in keys)
    assert len(h.signals(redis_client, "idempotent_skipped")) == 990
    if coordination_conf:
        store = get_lock_backend(make_app(**coordination_conf))
        assert all(store.idempotent_done(f"invoice:{t}:{p}") for t, p in keys)
        client_app.close()
        return
    # the marker lives for its whole window from when it was written (a loaded machine takes a while
    # to get here, so measure from the marker's own finished_at, on Redis' clock)
    marker = json.loads(redis_client.get("safe_time:idem:invoice:0:2026-11") or b"{}")
    seconds, micros = redis_client.time()
    left = marker["finished_at"] + 120 - (seconds + micros / 1e6)
    assert abs(redis_client.pttl("safe_time:idem:invoice:0:2026-11") / 1000 - left) < 2.0
    client_app.close()


def test_idempotent_failed_run_records_nothing(
    processes: ProcessManager,
    client_app: Celery,
    redis_client: redis.Redis,
    redis_url: str,
    coordination_conf: dict[str, Any],
    make_app: Callable[..., Celery],
) -> None:
    env = h.broker_env(redis_url, redis_url, coordination=coordination_conf)
    store = get_lock_backend(make_app(**coordination_conf))
    h.start_worker(processes, ttl=3.0, retry_after=0.3, concurrency=4, env=env)
    failed = client_app.send_task("locks.invoice", args=(99, "2026-12"), kwargs={"fail": True})
    failed.get(timeout=30, propagate=False)
    assert failed.state == "FAILURE"
    assert not store.idempotent_done("invoice:99:2026-12")
    assert store.token_of("idem:invoice:99:2026-12") is None

    later = client_app.send_task("locks.invoice", args=(99, "2026-12"))
    assert later.get(timeout=30) == "sent 99:2026-12"
    again = client_app.send_task("locks.invoice", args=(99, "2026-12"))
    assert again.get(timeout=30) is None
    assert [r["outcome"] for r in h.runs(redis_client, "invoice")] == ["failed", "sent"]
    assert store.idempotent_done("invoice:99:2026-12")


def test_redis_unreachable_never_runs_unguarded(
    processes: ProcessManager, client_app: Celery, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    import json

    lock_redis = redis_server.url
    redis_server.stop()
    worker = h.start_worker(
        processes,
        ttl=3.0,
        retry_after=0.5,
        concurrency=4,
        env={"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_redis_url": lock_redis})},
    )
    retried = client_app.send_task("locks.guarded", args=("down",))
    raised = client_app.send_task("locks.guarded_raise", args=("down",))
    raised.get(timeout=30, propagate=False)
    assert raised.state == "FAILURE"
    assert "RedisUnavailable" in repr(raised.result)
    wait_for(lambda: worker.log().count("re-queueing " + retried.id) >= 3, 30, message="three re-queues")
    assert h.runs(redis_client) == [], "no body may run while the lock Redis is down"

    redis_server.start()
    assert retried.get(timeout=30) == "ran"
    assert [r["name"] for r in h.runs(redis_client)] == ["guarded"]


def test_fencing_number_grows_across_holders_in_plain_tasks(
    processes: ProcessManager, client_app: Celery, redis_client: redis.Redis
) -> None:
    h.start_worker(processes, concurrency=4)
    fences = [client_app.send_task("locks.plain", args=(3,)).get(timeout=30) for _ in range(3)]
    # seeded from Redis TIME in microseconds (so a Redis reset never restarts them below), then +1
    assert fences[0] > 1_700_000_000_000_000
    assert fences == [fences[0], fences[0] + 1, fences[0] + 2]
    assert [r["fence"] for r in h.runs(redis_client, "plain")] == fences
    assert redis_client.get("safe_time:lock-fence:plain:3") == str(fences[2]).encode()


def test_threads_pool_excludes_too(processes: ProcessManager, client_app: Celery, redis_client: redis.Redis) -> None:
    worker = processes.worker(
        h.APP,
        name="threads",
        concurrency=4,
        pool="threads",
        env={"SAFE_TIME_TEST_LOCK_TTL": "1.5", "SAFE_TIME_TEST_RETRY_AFTER": "0.2"},
    )
    worker.wait_for_log(r"ready\.", timeout=90)
    # each body (2 s) outlives the ttl (1.5 s): exclusion holds only because the renewer thread works
    results = [client_app.send_task("locks.sync", args=(5, 2.0)) for _ in range(3)]
    assert [r.get(timeout=60) for r in results] == [5] * 3
    intervals = [(r["started"], r["finished"]) for r in h.runs(redis_client, "sync")]
    assert len(intervals) == 3
    assert h.overlaps(intervals) == []
    fences = [r["fence"] for r in sorted(h.runs(redis_client, "sync"), key=lambda r: r["started"])]
    assert fences == [fences[0], fences[0] + 1, fences[0] + 2]


@pytest.mark.parametrize(
    ("task", "lock", "marker"),
    [
        ("locks.forgetful", "forgetful:a", None),
        ("locks.forgetful_invoice", "idem:forgetful-invoice:a", "safe_time:idem:forgetful-invoice:a"),
    ],
)
def test_a_release_sent_without_waiting_that_redis_refused_is_sent_again(
    processes: ProcessManager, redis_server: RedisServer, task: str, lock: str, marker: str | None
) -> None:
    """A delivered task's release (or commit) is sent without waiting for its answer, which is read
    after the task, before the delivery is acknowledged. On a Redis of its own (SCRIPT FLUSH reaches
    every client of a server): the body makes Redis forget the scripts, so that release is refused
    (NOSCRIPT). It is sent again on redis-py's path right after the task, with no later lock call of
    the process: the 30 s lock is freed, the finished-delivery marker (and the idempotency marker)
    recorded."""
    client = redis.Redis.from_url(redis_server.url)
    app = h.client_app(redis_server.url)
    try:
        h.start_worker(processes, concurrency=1, env=h.broker_env(redis_server.url, redis_server.url))
        first = app.send_task(task, args=("a",))
        assert first.get(timeout=30) == "ran"
        wait_for(lambda: not _exists(client, lock), 10, message="the refused release sent again after the task")
        assert client.keys(f"safe_time:lock-done:{lock}:*"), "the delivery is recorded as finished"
        if marker is not None:
            assert client.exists(marker)
            # a later call of the key is skipped: the body ran once
            assert app.send_task(task, args=("a",)).get(timeout=30) is None
            assert len(h.runs(client, "forgetful_invoice")) == 1
    finally:
        app.close()
        client.close()
