"""The same unique tasks three ways, for ``benchmarks.unique``: ``SafeTask(unique=...)``, celery-once's
``QueueOnce`` and celery-singleton's ``Singleton``, each with the same key (the argument ``n``) and the
same ttl (``SAFE_TIME_BENCH_UNIQUE_TTL``). Every body start is appended to ``bench:unique:starts``.

Per library: ``hold`` sleeps, ``flaky`` retries itself once after 3 s, ``limited`` hits a 2 s hard time
limit, ``plain`` (ours only) is a SafeTask without ``unique=``, the enqueue baseline.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_safe_time import SafeTask

URL = os.environ["SAFE_TIME_BENCH_BROKER_URL"]
TTL = float(os.environ.get("SAFE_TIME_BENCH_UNIQUE_TTL", "15"))
STARTS = "bench:unique:starts"
RETRY_COUNTDOWN = 3.0
HARD_LIMIT = 2.0

app = Celery("bench-unique", broker=URL, backend=URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    safe_time_redis_url=URL,
    safe_time_store_url="memory://bench-unique",
    timezone="UTC",
    # celery-once: its Redis backend, the same ttl; graceful: a duplicate returns instead of raising.
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": URL, "default_timeout": int(TTL)}},
    # celery-singleton: its Redis backend (lock_expiry defaults to no expiry at all: the same ttl here).
    singleton_backend_url=URL,
    singleton_lock_expiry=int(TTL),
)
_records = redis.Redis.from_url(URL)


def _note(lib: str, name: str, task: Task) -> None:
    request = task.request
    entry = {"lib": lib, "name": name, "task_id": request.id, "retries": request.retries, "at": time.time()}
    _records.rpush(STARTS, json.dumps(entry))


def _body(lib: str, name: str, task: Task, n: int, seconds: float) -> int:
    _note(lib, name, task)
    if name == "flaky" and task.request.retries == 0:
        raise task.retry(countdown=RETRY_COUNTDOWN)
    time.sleep(seconds)
    return n


ours_options: dict[str, Any] = {"base": SafeTask, "bind": True, "unique": "bench:{n}", "unique_ttl": TTL}
once_options: dict[str, Any] = {
    "base": QueueOnce,
    "bind": True,
    "once": {"graceful": True, "keys": ["n"], "timeout": int(TTL)},
}
singleton_options: dict[str, Any] = {"base": Singleton, "bind": True, "unique_on": ["n"], "lock_expiry": int(TTL)}


@app.task(name="ours.plain", base=SafeTask, bind=True)
def ours_plain(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("ours", "plain", self, n, seconds)


@app.task(name="ours.hold", **ours_options)
def ours_hold(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("ours", "hold", self, n, seconds)


@app.task(name="ours.flaky", **ours_options)
def ours_flaky(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("ours", "flaky", self, n, seconds)


@app.task(name="ours.limited", time_limit=HARD_LIMIT, **ours_options)
def ours_limited(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("ours", "limited", self, n, seconds)


@app.task(name="once.hold", **once_options)
def once_hold(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("once", "hold", self, n, seconds)


@app.task(name="once.flaky", **once_options)
def once_flaky(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("once", "flaky", self, n, seconds)


@app.task(name="once.limited", time_limit=HARD_LIMIT, **once_options)
def once_limited(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("once", "limited", self, n, seconds)


@app.task(name="singleton.hold", **singleton_options)
def singleton_hold(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("singleton", "hold", self, n, seconds)


@app.task(name="singleton.flaky", **singleton_options)
def singleton_flaky(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("singleton", "flaky", self, n, seconds)


@app.task(name="singleton.limited", time_limit=HARD_LIMIT, **singleton_options)
def singleton_limited(self: Task, n: int, seconds: float = 0.0) -> int:
    return _body("singleton", "limited", self, n, seconds)


TASKS: dict[str, dict[str, Task]] = {
    "ours": {"hold": ours_hold, "flaky": ours_flaky, "limited": ours_limited, "plain": ours_plain},
    "once": {"hold": once_hold, "flaky": once_flaky, "limited": once_limited},
    "singleton": {"hold": singleton_hold, "flaky": singleton_flaky, "limited": singleton_limited},
}
#: Where each library keeps its key (a glob over the Redis keys).
KEY_PATTERNS = {"ours": "safe_time:unique:*", "once": "qo_*", "singleton": "SINGLETONLOCK_*"}
