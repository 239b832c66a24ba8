"""Tasks under ``overlap_lock`` / ``idempotent`` that record every run in Redis.

Runs go to the list ``test:locks:runs`` as JSON (name, key, task id, started, finished, fence,
pid, outcome); every ``overlap_conflict`` / ``idempotent_skipped`` / ``overlap_lock_lost``
signal goes to ``test:locks:signals``; ``test:locks:started:<label>`` is set when a body starts.
Lock ttl and retry pauses come from ``SAFE_TIME_TEST_LOCK_TTL`` / ``SAFE_TIME_TEST_RETRY_AFTER``.
``SAFE_TIME_TEST_REDIS_URL`` is the Redis the records go to when the broker is not Redis (RabbitMQ);
every body start of ``locks.durable`` is appended to ``test:locks:starts``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from celery_safe_time import SafeTask, concurrency_limit, idempotent, install, overlap_lock, rate_limit, signals
from celery_safe_time.exceptions import LockLost
from celery_safe_time.locks import current_fence, current_lock
from celery_safe_time.messages.requeue import message_header
from tests.apps.settings import configure
from tests.apps.stack_gates import STACK_GATES

app = configure(Celery("locks_app"))
if os.environ.get("SAFE_TIME_TEST_INSTALL"):
    # The sweep task and its entry: a gate's long wait then goes through the store.
    install(app)
_redis = redis.Redis.from_url(os.environ.get("SAFE_TIME_TEST_REDIS_URL") or os.environ["SAFE_TIME_TEST_BROKER_URL"])

TTL = float(os.environ.get("SAFE_TIME_TEST_LOCK_TTL", "3"))
RETRY_AFTER = float(os.environ.get("SAFE_TIME_TEST_RETRY_AFTER", "0.5"))
RUNS = "test:locks:runs"
SIGNALS = "test:locks:signals"
STARTS = "test:locks:starts"


def record(name: str, key: Any, task_id: str | None, started: float, **extra: Any) -> None:
    _redis.rpush(
        RUNS,
        json.dumps(
            {
                "name": name,
                "key": key,
                "task_id": task_id,
                "started": started,
                "finished": time.time(),
                "pid": os.getpid(),
                **extra,
            }
        ),
    )


def _on_signal(name: str) -> Any:
    def handler(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        _redis.rpush(SIGNALS, json.dumps({**kwargs, "signal": name, "at": time.time()}, default=str))

    return handler


signals.overlap_conflict.connect(_on_signal("overlap_conflict"), weak=False)
signals.overlap_lock_lost.connect(_on_signal("overlap_lock_lost"), weak=False)
signals.idempotent_skipped.connect(_on_signal("idempotent_skipped"), weak=False)
signals.rate_limit_admitted.connect(_on_signal("rate_limit_admitted"), weak=False)
signals.rate_limited.connect(_on_signal("rate_limited"), weak=False)

RATE = os.environ.get("SAFE_TIME_TEST_RATE", "20/s")
RATED = "test:locks:rated"


@app.task(bind=True, name="locks.sync")
@overlap_lock("sync:{account}", ttl=TTL, on_conflict="retry", retry_after=RETRY_AFTER)
def sync(self, account: int, seconds: float = 2.0) -> int:  # type: ignore[no-untyped-def]
    started = time.time()
    _redis.set(f"test:locks:started:{self.request.id}", started)
    time.sleep(seconds)
    record("sync", account, self.request.id, started, fence=self.request.safe_time_fence)
    return account


@app.task(name="locks.plain")
@overlap_lock(lambda account, **_: f"plain:{account}", ttl=TTL, on_conflict="retry", retry_after=RETRY_AFTER)
def plain(account: int, seconds: float = 0.0) -> int | None:
    started = time.time()
    time.sleep(seconds)
    record("plain", account, None, started, fence=current_fence())
    return current_fence()


@app.task(bind=True, name="locks.skipper")
@overlap_lock("shared:{key}", ttl=TTL, on_conflict="skip")
def skipper(self, key: str, seconds: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    started = time.time()
    _redis.set(f"test:locks:started:{self.request.id}", started)
    time.sleep(seconds)
    record("skipper", key, self.request.id, started, fence=self.request.safe_time_fence)
    return "ran"


@app.task(bind=True, name="locks.raiser")
@overlap_lock("shared:{key}", ttl=TTL, on_conflict="raise")
def raiser(self, key: str) -> str:  # type: ignore[no-untyped-def]
    record("raiser", key, self.request.id, time.time())
    return "ran"


@app.task(bind=True, name="locks.retrier")
@overlap_lock("shared:{key}", ttl=TTL, on_conflict="retry", retry_after=1.0, jitter=0.5)
def retrier(self, key: str) -> str:  # type: ignore[no-untyped-def]
    requeues = (self.request.headers or {}).get("safe_time_requeues")
    record("retrier", key, self.request.id, time.time(), retries=self.request.retries, requeues=requeues)
    return "ran"


@app.task(bind=True, name="locks.exit_path", max_retries=1)
@overlap_lock("exit:{mode}", ttl=30, on_conflict="raise")
def exit_path(self, mode: str) -> str:  # type: ignore[no-untyped-def]
    """Leaves the body in the way ``mode`` says; the 30 s ttl shows the release was explicit."""
    started = time.time()
    _redis.set(f"test:locks:started:{mode}", started)
    record("exit_path", mode, self.request.id, started, retries=self.request.retries)
    if mode == "exception":
        raise RuntimeError("boom")
    if mode == "retry":
        raise self.retry(countdown=120)
    if mode == "ignore":
        raise Ignore()
    if mode == "reject":
        raise Reject("rejected", requeue=False)
    if mode in ("soft", "hard"):
        try:
            time.sleep(60)
        except SoftTimeLimitExceeded:
            _redis.set(f"test:locks:soft:{mode}", 1)
            raise
    if mode == "hard_stubborn":
        # billiard sends SIGTERM first (SystemExit here, so ``finally`` blocks would release);
        # this body ignores it, so only the SIGKILL 0.1 s later ends it, and no finally runs.
        try:
            time.sleep(60)
        except SystemExit:
            time.sleep(60)
    return "ok"


@app.task(bind=True, name="locks.hold")
@overlap_lock("hold:{key}", ttl=TTL, on_conflict="skip")
def hold(self, key: str, seconds: float) -> str:  # type: ignore[no-untyped-def]
    """Holds ``key`` for ``seconds`` in small sleeps; records a LockLost if the lock goes away."""
    started = time.time()
    _redis.set(f"test:locks:started:{self.request.id}", started)
    outcome = "finished"
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except LockLost:
        outcome = "lost"
        raise
    finally:
        record("hold", key, self.request.id, started, fence=self.request.safe_time_fence, outcome=outcome)
    return outcome


@app.task(bind=True, name="locks.invoice")
@idempotent("invoice:{tenant}:{period}", window=120, ttl=TTL, retry_after=RETRY_AFTER)
def invoice(self, tenant: int, period: str, fail: bool = False, seconds: float = 0.1) -> str:  # type: ignore[no-untyped-def]
    started = time.time()
    time.sleep(seconds)
    if fail:
        record("invoice", f"{tenant}:{period}", self.request.id, started, outcome="failed")
        raise RuntimeError("invoice failed")
    record("invoice", f"{tenant}:{period}", self.request.id, started, outcome="sent")
    return f"sent {tenant}:{period}"


@app.task(bind=True, name="locks.guarded")
@overlap_lock("guarded:{key}", ttl=TTL, retry_after=RETRY_AFTER)
def guarded(self, key: str) -> str:  # type: ignore[no-untyped-def]
    record("guarded", key, self.request.id, time.time())
    return "ran"


@app.task(bind=True, name="locks.guarded_raise")
@overlap_lock("guarded:{key}", ttl=TTL, on_backend_error="raise")
def guarded_raise(self, key: str) -> str:  # type: ignore[no-untyped-def]
    record("guarded_raise", key, self.request.id, time.time())
    return "ran"


@app.task(bind=True, name="locks.durable", acks_late=True)
@overlap_lock("durable:{key}", ttl=TTL, on_conflict="skip", retry_after=RETRY_AFTER, jitter=0.1)
def durable(self, key: str, seconds: float = 2.0) -> str:  # type: ignore[no-untyped-def]
    """acks_late and on_conflict="skip": a redelivered copy must be re-queued, never skipped or dropped."""
    started = time.time()
    start = {"task_id": self.request.id, "hostname": self.request.hostname, "started": started, "pid": os.getpid()}
    _redis.rpush(STARTS, json.dumps(start))
    time.sleep(seconds)
    requeues = (self.request.headers or {}).get("safe_time_requeues")
    record(
        "durable",
        key,
        self.request.id,
        started,
        fence=self.request.safe_time_fence,
        retries=self.request.retries,
        requeues=requeues,
    )
    return "ran"


@app.task(bind=True, name="locks.once_skip")
@overlap_lock("once:{key}", ttl=30, on_conflict="skip", retry_after=0.3, jitter=0.1)
def once_skip(self, key: str) -> str:  # type: ignore[no-untyped-def]
    """A 30 s lock with on_conflict="skip": an orphaned lock of its own would make it skip its only run."""
    record("once_skip", key, self.request.id, time.time(), fence=self.request.safe_time_fence)
    return "ran"


@app.task(bind=True, name="locks.forgetful")
@overlap_lock("forgetful:{key}", ttl=30, on_conflict="raise")
def forgetful(self, key: str) -> str:  # type: ignore[no-untyped-def]
    """Makes Redis forget its scripts while holding a 30 s lock: the release, sent without waiting for
    its answer, is refused (NOSCRIPT) and must be sent again before this process's next lock call."""
    _redis.script_flush()
    return "ran"


@app.task(bind=True, name="locks.forgetful_invoice")
@idempotent("forgetful-invoice:{key}", window=120, ttl=30, on_conflict="raise")
def forgetful_invoice(self, key: str) -> str:  # type: ignore[no-untyped-def]
    """:func:`forgetful` under ``idempotent``: its commit (marker and release) is what is refused."""
    _redis.script_flush()
    record("forgetful_invoice", key, self.request.id, time.time())
    return "ran"


@app.task(bind=True, name="locks.rated")
@rate_limit("rated:{key}", RATE)
def rated(self, key: str, n: int) -> int:  # type: ignore[no-untyped-def]
    """Records its start (``test:locks:rated``) as its first act: the rate is about starts."""
    at = time.time()
    requeues = message_header(self.request, "safe_time_requeues") or 0
    _redis.rpush(RATED, json.dumps({"at": at, "key": key, "n": n, "task_id": self.request.id, "requeues": requeues}))
    return n


@app.task(bind=True, name="locks.slots")
@concurrency_limit("slots:{key}", limit=3, ttl=TTL, on_conflict="retry", retry_after=RETRY_AFTER)
def slots(self, key: str, seconds: float) -> str:  # type: ignore[no-untyped-def]
    started = time.time()
    held = current_lock()
    assert held is not None
    _redis.set(f"test:locks:started:{self.request.id}", started)
    time.sleep(seconds)
    record("slots", key, self.request.id, started, fence=held.fence, slot=held.key)
    return held.key


@app.task(bind=True, name="locks.pair")
@concurrency_limit("pair:{key}", limit=2, ttl=TTL, on_conflict="retry", retry_after=RETRY_AFTER)
def pair(self, key: str, seconds: float) -> str:  # type: ignore[no-untyped-def]
    """Two at once per key: records each run's interval (``test:locks:runs``) to check for a third."""
    started = time.time()
    held = current_lock()
    assert held is not None
    time.sleep(seconds)
    record("pair", key, self.request.id, started, slot=held.key)
    return held.key


# The same limits as SafeTask options (checked when the worker creates the task classes).
@app.task(
    bind=True,
    base=SafeTask,
    name="locks.rated_option",
    safe_time_rate_limit=RATE,
    safe_time_rate_key="rated-option:{key}",
)
def rated_option(self, key: str, n: int) -> int:  # type: ignore[no-untyped-def]
    at = time.time()
    requeues = message_header(self.request, "safe_time_requeues") or 0
    _redis.rpush(RATED, json.dumps({"at": at, "key": key, "n": n, "task_id": self.request.id, "requeues": requeues}))
    return n


@app.task(
    bind=True,
    base=SafeTask,
    name="locks.slots_option",
    safe_time_concurrency_limit=3,
    safe_time_concurrency_key="slots-option:{key}",
)
def slots_option(self, key: str, seconds: float) -> str:  # type: ignore[no-untyped-def]
    held = current_lock()
    assert held is not None
    _redis.set(f"test:locks:started:{self.request.id}", time.time())
    time.sleep(seconds)
    return held.key


# Stacked gates (issue 38): an outer gate around an inner rate limit, and a long acks_late body under
# a concurrency limit of 2 (a Redis broker hands it out again past its visibility timeout).
STACKED_RATE = os.environ.get("SAFE_TIME_TEST_STACKED_RATE", "1/3s")


@app.task(bind=True, name="locks.lock_over_rate")
@overlap_lock("lock-over-rate:{key}", ttl=TTL, retry_after=RETRY_AFTER)
@rate_limit("lock-over-rate-line:{key}", STACKED_RATE)
def lock_over_rate(self, key: str, n: int) -> int:  # type: ignore[no-untyped-def]
    started = time.time()
    record("lock_over_rate", key, self.request.id, started, n=n)
    return n


@app.task(bind=True, name="locks.slots_over_rate")
@concurrency_limit("slots-over-rate:{key}", limit=2, ttl=TTL, retry_after=RETRY_AFTER)
@rate_limit("slots-over-rate-line:{key}", STACKED_RATE)
def slots_over_rate(self, key: str, n: int) -> int:  # type: ignore[no-untyped-def]
    started = time.time()
    record("slots_over_rate", key, self.request.id, started, n=n)
    return n


@app.task(bind=True, name="locks.long_slot", acks_late=True)
@concurrency_limit("long-slot:{key}", limit=2, ttl=TTL, retry_after=RETRY_AFTER)
def long_slot(self, key: str, seconds: float) -> str:  # type: ignore[no-untyped-def]
    started = time.time()
    held = current_lock()
    assert held is not None
    _redis.rpush(STARTS, json.dumps({"task_id": self.request.id, "at": started, "slot": held.key}))
    time.sleep(seconds)
    record("long_slot", key, self.request.id, started, slot=held.key)
    return held.key


# Every ordered pair of STACK_GATES as one acks_late task ``locks.stack.<outer>.<inner>`` (the first
# gate outermost), for tests/faults/test_composition_faults.py. Each body records its start
# (``test:locks:starts``) and its end (a run, with its fence).
def _stacked(outer: str, inner: str) -> None:
    def body(self, key: str, n: int, seconds: float) -> int:  # type: ignore[no-untyped-def]
        started = time.time()
        _redis.rpush(STARTS, json.dumps({"task_id": self.request.id, "n": n, "at": started, "pid": os.getpid()}))
        time.sleep(seconds)
        record("stack", key, self.request.id, started, n=n, pair=f"{outer}.{inner}", fence=current_fence())
        return n

    body.__name__ = f"stack_{outer}_{inner}"
    wrapped = STACK_GATES[outer][1](TTL, RETRY_AFTER)(STACK_GATES[inner][1](TTL, RETRY_AFTER)(body))
    app.task(bind=True, name=f"locks.stack.{outer}.{inner}", acks_late=True)(wrapped)


for _outer, _inner in itertools.permutations(STACK_GATES, 2):
    _stacked(_outer, _inner)
