"""The app of the combined fault scenario (``tests/faults``): every feature at once.

- ``SAFE_TIME_TEST_BROKER_URL``: broker and result backend (never restarted by the scenario).
- ``SAFE_TIME_TEST_RECORD_URL``: where runs are recorded (default: the broker); never flushed. A
  ``file:///dir`` URL records them in append-only JSON-lines files of that directory instead, one per
  kind and process (the run on PostgreSQL coordination, where no Redis may be used at all).
- ``safe_time_redis_url`` (through ``SAFE_TIME_TEST_APP_CONF``): the lease/lock Redis the
  scenario restarts and flushes.
- ``SAFE_TIME_TEST_BEAT_SCHEDULE``: JSON periodic entries (``every`` seconds or ``cron`` kwargs).

Records (JSON lists in the record Redis, or ``<kind>.<pid>.jsonl`` files): ``faults:delay`` (stored
delays, one item per start), ``faults:delay_end`` (one item per run that reached its end),
``faults:periodic`` (entry, slot, epoch), ``faults:lock`` (key, start, end, fence, outcome),
``faults:idem`` (key, start), ``faults:idem_ok`` (task id, after its marker was written),
``faults:delay_given_back`` (a stored delay whose first run gave its message back: ``Reject(requeue=True)``,
``retry()`` or ``SystemExit``), ``faults:stacked`` (a run of a task with stacked gates: task, key, call,
start, end, outcome), ``faults:stacked_published`` (beat's publish of a slot of the stacked entry).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from celery import Celery
from celery.exceptions import Reject
from celery.signals import after_task_publish, beat_init, task_success

from celery_safe_time import SafeTask, concurrency_limit, crontab, idempotent, install, overlap_lock, rate_limit
from celery_safe_time import constants as C
from celery_safe_time.exceptions import LockLost
from celery_safe_time.locks.overlap import current_lock
from tests.apps.settings import configure

app = configure(Celery("faults_app"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
)
install(app)

_RECORD_URL = os.environ.get("SAFE_TIME_TEST_RECORD_URL") or os.environ["SAFE_TIME_TEST_BROKER_URL"]
#: The directory of a ``file:///dir`` record URL, else None (a Redis URL).
RECORD_DIR = Path(unquote(urlsplit(_RECORD_URL).path)) if _RECORD_URL.startswith("file:") else None
# redis-py connects on first use only: with a record directory this client never talks to Redis.
_record = None if RECORD_DIR else redis.Redis.from_url(_RECORD_URL, socket_timeout=10, socket_connect_timeout=10)
_files: dict[tuple[int, str], int] = {}

LOCK_TTL = float(os.environ.get("SAFE_TIME_TEST_LOCK_TTL", "10"))


def _push(kind: str, **data: Any) -> None:
    line = json.dumps({**data, "pid": os.getpid()})
    if _record is not None:
        _record.rpush(f"faults:{kind}", line)
        return
    assert RECORD_DIR is not None
    # A file per kind and process (keyed by pid: a prefork child opens its own after the fork); one
    # os.write per line on an O_APPEND descriptor, so a kill -9 leaves whole lines only.
    key = (os.getpid(), kind)
    fd = _files.get(key)
    if fd is None:
        path = RECORD_DIR / f"{kind}.{os.getpid()}.jsonl"
        fd = _files[key] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (line + "\n").encode())


#: Stored delays whose first run gives its message back, by the delay's number modulo 40: the body
#: raises ``Reject(requeue=True)``, calls ``retry(countdown=1)`` or raises ``SystemExit`` (the pool
#: child exits; ``reject_on_worker_lost`` gives the message back). Each must still run to its end once.
BODY_FAULTS = {7: "reject", 17: "retry", 27: "exit"} if os.environ.get("SAFE_TIME_TEST_BODY_FAULTS") else {}


def _first_time(label: str) -> bool:
    """True once per label across every process of the run (the record store keeps the flag)."""
    if _record is not None:
        return bool(_record.set(f"faults:once:{label}", 1, nx=True))
    assert RECORD_DIR is not None
    try:
        os.close(os.open(RECORD_DIR / f"once.{label}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


@app.task(bind=True, base=SafeTask, name="faults.delay", reject_on_worker_lost=True)
def delay(self: Any, label: str) -> str:
    """A stored delay (acks_late, like every task here): records its start and, after a short body a
    kill -9 can cut, its end. A run killed mid-body runs again (at least once), never beside itself.
    Some give their first run's message back (:data:`BODY_FAULTS`)."""
    headers = self.request.headers or {}
    started = time.time()
    worker = self.request.hostname
    _push(
        "delay",
        label=label,
        task_id=self.request.id,
        started=started,
        stored=headers.get(C.HEADER_STORED),
        worker=worker,
    )
    time.sleep(0.15)
    fault = BODY_FAULTS.get(int(label[1:]) % 40)
    if fault is not None and _first_time(label):
        _push(
            "delay_given_back", task_id=self.request.id, fault=fault, started=started, ended=time.time(), worker=worker
        )
        if fault == "reject":
            raise Reject("given back by the fault scenario", requeue=True)
        if fault == "retry":
            raise self.retry(countdown=1)
        raise SystemExit(1)
    _push("delay_end", task_id=self.request.id, started=started, ended=time.time(), worker=worker)
    return label


# Periodic runs are at most once (the beat promise): acked on start, never redelivered.
@app.task(bind=True, name="faults.periodic", acks_late=False)
def periodic(self: Any, entry: str) -> str:
    headers = self.request.headers or {}
    _push(
        "periodic",
        entry=entry,
        task_id=self.request.id,
        slot=headers.get(C.HEADER_SLOT),
        epoch=headers.get(C.HEADER_EPOCH),
        started=time.time(),
    )
    return entry


@app.task(bind=True, name="faults.locked")
@overlap_lock("fault-lock:{key}", ttl=LOCK_TTL, retry_after=0.5, jitter=0.5)
def locked(self: Any, key: int, n: int, seconds: float = 0.2) -> int:
    started = time.time()
    fence = self.request.safe_time_fence
    outcome = "finished"
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        # Before the "critical write": a holder that lost its lock must not write.
        self.request.safe_time_lock.check()
    except LockLost:
        outcome = "lost"
        raise
    finally:
        _push(
            "lock",
            key=key,
            n=n,
            task_id=self.request.id,
            started=started,
            ended=time.time(),
            fence=fence,
            outcome=outcome,
        )
    return n


@app.task(bind=True, name="faults.idem")
@idempotent("fault-idem:{key}", window=3600, ttl=LOCK_TTL, retry_after=0.5)
def idem(self: Any, key: int, copy: int) -> int:
    _push("idem", key=key, copy=copy, task_id=self.request.id, started=time.time())
    return key


@task_success.connect(sender=idem)
def _idem_done(sender: Any = None, **kwargs: Any) -> None:
    """After the body returned and the marker was written: a run with no such record was cut
    short (kill -9) before its marker existed, which the docs admit lets a later call run."""
    _push("idem_ok", task_id=sender.request.id, at=time.time())


# --- stacked gates (docs/locks.md, "Stacking gates"): as users stack them --------------------------

#: The rates of the stacked tasks (tests/faults/test_soak.py checks the starts against them).
LOCK_OVER_RATE = "2/2s"
SLOTS_OVER_RATE = "3/2s"
ENTRY_RATE = "1/1500ms"


def _stacked(self: Any, kind: str, key: Any, call: Any, seconds: float) -> None:
    """A body that records one run of a stacked task: its start, its end, and whether the lock it
    ran under (the innermost one) was still held before its "critical write"."""
    started = time.time()
    held = current_lock()
    outcome = "finished"
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        if held is not None:
            held.check()
    except LockLost:
        outcome = "lost"
        raise
    finally:
        _push(
            "stacked",
            task=kind,
            key=key,
            call=call,
            task_id=self.request.id,
            started=started,
            ended=time.time(),
            outcome=outcome,
            lock=held.key if held is not None else None,
            worker=self.request.hostname,
        )


@app.task(bind=True, name="faults.lock_over_rate")
@overlap_lock("fault-lr:{key}", ttl=LOCK_TTL, retry_after=0.5, jitter=0.5)
@rate_limit("fault-lr-rate:{key}", LOCK_OVER_RATE)
def lock_over_rate(self: Any, key: int, n: int, seconds: float) -> int:
    """``overlap_lock`` above ``rate_limit``: one run of a key at a time, at most 2 starts in 2 s."""
    _stacked(self, "lock_over_rate", key, n, seconds)
    return n


@app.task(bind=True, name="faults.slots_over_rate")
@concurrency_limit("fault-sr:{key}", limit=2, ttl=LOCK_TTL, retry_after=0.5, jitter=0.5)
@rate_limit("fault-sr-rate:{key}", SLOTS_OVER_RATE)
def slots_over_rate(self: Any, key: int, n: int, seconds: float) -> int:
    """``concurrency_limit(limit=2)`` above ``rate_limit``: 2 runs of a key at once, 3 starts in 2 s."""
    _stacked(self, "slots_over_rate", key, n, seconds)
    return n


@app.task(bind=True, name="faults.entry_over_rate")
@rate_limit("fault-entry-rate:{entry}", ENTRY_RATE)
def entry_over_rate(self: Any, entry: str) -> str:
    """The task of a beat entry with an overlap policy (its run lease is the outer gate) under a rate."""
    _stacked(self, "entry_over_rate", entry, str((self.request.headers or {}).get(C.HEADER_SLOT)), 0.1)
    return entry


_in_beat = False


@beat_init.connect
def _beat_started(**_: Any) -> None:
    global _in_beat
    _in_beat = True


@after_task_publish.connect
def _published(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Beat's publish of a slot of an entry with an overlap policy (handed to the broker). A gate's
    re-queue (``safe_time_requeues``) and a sweep's publish of a stored wait are the same call."""
    headers = headers or {}
    spec = headers.get(C.HEADER_OVERLAP)
    if _in_beat and isinstance(spec, dict) and C.HEADER_LOCK_REQUEUES not in headers:
        _push(
            "stacked_published",
            entry=spec.get("entry"),
            task_id=headers.get("id"),
            slot=headers.get(C.HEADER_SLOT),
            at=time.time(),
        )


def _entry(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    schedule: Any = crontab(**spec["cron"]) if "cron" in spec else float(spec["every"])
    entry = {"task": spec.get("task", "faults.periodic"), "schedule": schedule, "args": [name]}
    entry.update({k: spec[k] for k in ("overlap", "overlap_ttl") if k in spec})
    return entry


app.conf.beat_schedule = {
    **(app.conf.beat_schedule or {}),
    **{
        name: _entry(name, spec)
        for name, spec in json.loads(os.environ.get("SAFE_TIME_TEST_BEAT_SCHEDULE", "{}")).items()
    },
}
