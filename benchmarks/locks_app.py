"""Worker app for ``benchmarks/locks.py``: the same trivial body bare, locked and idempotent.

The worker times every task from ``task_prerun`` to ``task_postrun`` (the decorators run in
between) and pushes the seconds to ``bench:durations:<task name>``; throughput tasks count
completions and record the first start and last finish.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun

from celery_safe_time import idempotent, overlap_lock
from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner, get_lock_backend, use_lock_backend
from celery_safe_time.locks.backends.memory import MemoryLockBackend
from celery_safe_time.locks.redis_wire import parse_reply
from celery_safe_time.locks.runtime import HeldLock
from celery_safe_time.redis_client import get_redis

BROKER = os.environ["SAFE_TIME_BENCH_BROKER_URL"]
#: Locks and the timings: the broker itself on Redis, a private redis-server beside RabbitMQ.
REDIS_URL = os.environ.get("SAFE_TIME_BENCH_REDIS_URL", BROKER)
app = Celery("bench_locks", broker=BROKER)
app.conf.update(
    safe_time_redis_url=REDIS_URL,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=True,
)
_redis = redis.Redis.from_url(REDIS_URL)
_started: dict[str, float] = {}
_HOST = socket.gethostname()


@task_prerun.connect
def _prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    switch = _SWITCHES.get(task.name) if task is not None else None
    if switch is not None:
        switch(True)
    if task_id is not None:
        _started[task_id] = time.perf_counter()
    if task is not None and task.name.startswith("bench.tp_"):
        _redis.set(f"bench:first:{task.name}", time.time(), nx=True)


@task_postrun.connect
def _postrun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    began = _started.pop(task_id or "", None)
    if task is None or began is None:
        return
    elapsed = time.perf_counter() - began
    switch = _SWITCHES.get(task.name)
    if switch is not None:
        switch(False)
    if task.name.startswith("bench.tp_"):
        pipe = _redis.pipeline(transaction=False)
        pipe.incr(f"bench:done:{task.name}")
        pipe.set(f"bench:last:{task.name}", time.time())
        pipe.execute()
    else:
        _redis.rpush(f"bench:durations:{task.name}", elapsed)


@app.task(name="bench.bare")
def bare(n: int) -> int:
    return n


@app.task(name="bench.locked")
@overlap_lock("bench:{n}", ttl=30)
def locked(n: int) -> int:
    return n


@app.task(name="bench.locked_before")
@overlap_lock("bench-before:{n}", ttl=30)
def locked_before(n: int) -> int:
    """overlap_lock as it was before the renewer stopped being woken on every acquire (the notify is
    put back for this task only, below): the before/after of that change in one run."""
    return n


def _renewer_add_waking() -> Any:
    """``_Renewer.add`` as it was before the renewer stopped being woken on every acquire."""
    from celery_safe_time.locks import watchdog

    add = watchdog._Renewer.add

    def add_and_wake(self: Any, dog: Any) -> None:
        add(self, dog)
        with self._cond:
            self._cond.notify()

    return add_and_wake


_ADD_NOW = None
_ADD_BEFORE = _renewer_add_waking()


def _use_before(on: bool) -> None:
    """Put the old ``add`` in place for one ``bench.locked_before`` run (outside its timed window),
    so no other task pays for the switch."""
    from celery_safe_time.locks import watchdog

    global _ADD_NOW
    if _ADD_NOW is None:
        _ADD_NOW = watchdog._Renewer.add
    watchdog._Renewer.add = _ADD_BEFORE if on else _ADD_NOW  # type: ignore[method-assign]


@app.task(name="bench.locked_waiting")
@overlap_lock("bench-waiting:{n}", ttl=30)
def locked_waiting(n: int) -> int:
    """overlap_lock waiting for its release's answer before the body returns, as before this answer was
    read after the task (``HeldLock.answer_later`` off for this task only, below)."""
    return n


@app.task(name="bench.idempotent_waiting")
@idempotent("bench-waiting:{n}", window=600, ttl=30)
def idem_waiting(n: int) -> int:
    """idempotent waiting for its commit's answer, as :func:`locked_waiting` for its release."""
    return n


def _answer_now(on: bool) -> None:
    HeldLock.answer_later = not on


@app.task(name="bench.locked_memory")
@overlap_lock("bench-memory:{n}", ttl=30)
def locked_memory(n: int) -> int:
    """overlap_lock on the in-process lock store (the testing plugin's): the decorator's own Python,
    no Redis, so the rows above show how much of a lock is round trips."""
    return n


_MEMORY_STORE: list[MemoryLockBackend] = []


def _use_memory(on: bool) -> None:
    """This app's locks on the in-process store for one ``bench.locked_memory`` run (switched outside
    the timed window, as every switch here)."""
    if not _MEMORY_STORE:
        _MEMORY_STORE.append(MemoryLockBackend(get_config(app)))
    use_lock_backend(app, _MEMORY_STORE[0] if on else None)


#: Per task name: what its run switches on before it starts and off after it ends (outside its timing).
_SWITCHES: dict[str, Callable[[bool], None]] = {
    "bench.locked_before": _use_before,
    "bench.locked_waiting": _answer_now,
    "bench.idempotent_waiting": _answer_now,
    "bench.tp_locked_waiting": _answer_now,
    "bench.locked_memory": _use_memory,
}


@app.task(name="bench.idempotent")
@idempotent("bench:{n}", window=600, ttl=30)
def idem(n: int) -> int:
    return n


@app.task(name="bench.ping")
def ping(n: int) -> int:
    """One Redis round trip on the lock client: the unit the lock overhead is made of."""
    get_redis(get_config(app).redis_url).ping()
    return n


@app.task(name="bench.ping2")
def ping2(n: int) -> int:
    """Two Redis round trips on the lock client, one after the other: what a lock must cost at least
    (acquire before the body, release after it)."""
    client = get_redis(get_config(app).redis_url)
    client.ping()
    client.ping()
    return n


_PING = b"*1\r\n$4\r\nPING\r\n"
_lean_conn: list[Any] = []


@app.task(name="bench.ping2_lean")
def ping2_lean(n: int) -> int:
    """Two PINGs the way the lock's scripts are sent (``celery_safe_time.locks.redis_wire``): written to a
    connection this process keeps and read off its socket, none of redis-py's command path. The
    floor of two round trips from Python; ``bench.ping2`` is two through redis-py."""
    if not _lean_conn:
        _lean_conn.append(get_redis(get_config(app).redis_url).connection_pool.get_connection())
    conn = _lean_conn[0]
    for _ in range(2):
        conn.send_packed_command([_PING])
        reply, _end = parse_reply(conn._sock.recv(65536))
        assert reply == b"PONG", reply
    return n


@app.task(name="bench.scripts", bind=True)
def scripts(self: Any, n: int) -> int:
    """The lock's two scripts (acquire, release with the finished-delivery record) called directly with
    the arguments overlap_lock passes: the round trips plus the work Redis does in them, without the
    decorator's Python around them."""
    store = get_lock_backend(app)
    owner = Owner(task_id=self.request.id, identity=f"{self.request.id}:0:0", host=_HOST, pid=os.getpid())
    token = uuid.uuid4().hex
    store.acquire(f"scripts:{n}", token, 30.0, owner)
    store.release(f"scripts:{n}", token, (owner.identity, 600.0, owner.task_id))
    return n


@app.task(name="bench.scripts_redispy", bind=True)
def scripts_redispy(self: Any, n: int) -> int:
    """The same two scripts through redis-py's command path (``Script``), as every lock call went
    before the lean path: the Redis lock the PostgreSQL one was first compared with."""
    store = get_lock_backend(app)
    owner = Owner(task_id=self.request.id, identity=f"{self.request.id}:0:0", host=_HOST, pid=os.getpid())
    token = uuid.uuid4().hex
    key = f"scripts-redispy:{n}"
    lock, fence, done = store.lock_key(key), store.fence_key(key), store.done_key(key, owner.identity)
    store._acquire.script(
        keys=[lock, fence, done], args=[token, 30000, owner.task_id, owner.host, owner.pid, owner.identity]
    )  # type: ignore[attr-defined]
    store._release.script(keys=[lock, done], args=[token, 600000, owner.task_id])  # type: ignore[attr-defined]
    return n


# --- the lock backends side by side: acquire + release on Redis and on PostgreSQL ----------------
#: The coordination database (``benchmarks/locks.py`` makes one per run); unset: the PostgreSQL rows are skipped.
PG_URL = os.environ.get("SAFE_TIME_BENCH_PG_URL", "")


#: What an operator who trades the crash window for speed sets: the server's own knob, in the URL.
NO_FLUSH_OPTIONS = "options=-csynchronous_commit%3Doff"


def _pg_app(mode: str, url: str) -> Celery:
    """An app that only carries settings: the worker's tasks use its lock store directly."""
    other = Celery(f"bench_pg_{mode}", broker=BROKER, set_as_current=False)
    other.conf.update(safe_time_coordination_url=url, safe_time_coordination_locks=mode.split("_")[0])
    return other


def _no_flush_url(url: str) -> str:
    return url + ("&" if "?" in url else "?") + NO_FLUSH_OPTIONS


_PG_APPS = (
    {
        "lease": _pg_app("lease", PG_URL),
        "session": _pg_app("session", PG_URL),
        "lease_noflush": _pg_app("lease_noflush", _no_flush_url(PG_URL)),
    }
    if PG_URL
    else {}
)


def _acquire_release(store: Any, request: Any, n: int) -> None:
    owner = Owner(task_id=request.id, identity=f"{request.id}:0:0", host=_HOST, pid=os.getpid())
    token = uuid.uuid4().hex
    store.acquire(f"backend:{n}", token, 30.0, owner)
    store.release(f"backend:{n}", token, (owner.identity, 600.0, owner.task_id))


@app.task(name="bench.pg_lease", bind=True)
def pg_lease(self: Any, n: int) -> int:
    """acquire + release on PostgreSQL lease rows (what overlap_lock does on that backend)."""
    _acquire_release(get_lock_backend(_PG_APPS["lease"]), self.request, n)
    return n


@app.task(name="bench.pg_lease_noflush", bind=True)
def pg_lease_noflush(self: Any, n: int) -> int:
    """acquire + release on PostgreSQL lease rows with ``synchronous_commit=off`` in the URL (no WAL
    flush per acquire: a crash can forget the last moments' acquires)."""
    _acquire_release(get_lock_backend(_PG_APPS["lease_noflush"]), self.request, n)
    return n


@app.task(name="bench.pg_session", bind=True)
def pg_session(self: Any, n: int) -> int:
    """acquire + release on PostgreSQL session advisory locks."""
    _acquire_release(get_lock_backend(_PG_APPS["session"]), self.request, n)
    return n


@app.task(name="bench.pg_select2")
def pg_select2(n: int) -> int:
    """Two ``SELECT 1`` round trips, each on a DBAPI connection checked out of the lock engine's pool
    as the lock's calls are: the floor of a PostgreSQL lock."""
    engine = get_lock_backend(_PG_APPS["lease"]).engine  # type: ignore[attr-defined]
    for _ in range(2):
        conn = engine.raw_connection()
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
        finally:
            conn.close()
    return n


@app.task(name="bench.tp_bare")
def tp_bare(n: int) -> int:
    return n


@app.task(name="bench.tp_locked")
@overlap_lock(lambda n: f"tp:{n % 100}", ttl=30, retry_after=0.05, jitter=0.05)
def tp_locked(n: int) -> int:
    return n


@app.task(name="bench.tp_locked_waiting")
@overlap_lock(lambda n: f"tp-waiting:{n % 100}", ttl=30, retry_after=0.05, jitter=0.05)
def tp_locked_waiting(n: int) -> int:
    """:func:`tp_locked` waiting for its release's answer, as :func:`locked_waiting`."""
    return n
