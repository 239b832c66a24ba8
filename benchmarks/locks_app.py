"""Worker app for ``benchmarks/locks.py``: the same trivial body bare, locked and idempotent.

The worker times every task from ``task_prerun`` to ``task_postrun`` (the decorators run in
between) and pushes the seconds to ``bench:durations:<task name>``; throughput tasks count
completions and record the first start and last finish.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun

from celery_safe_time import idempotent, overlap_lock
from celery_safe_time.config import get_config
from celery_safe_time.redis_client import get_redis

BROKER = os.environ["SAFE_TIME_BENCH_BROKER_URL"]
app = Celery("bench_locks", broker=BROKER)
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=True,
)
_redis = redis.Redis.from_url(BROKER)
_started: dict[str, float] = {}


@task_prerun.connect
def _prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
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


@app.task(name="bench.idempotent")
@idempotent("bench:{n}", window=600, ttl=30)
def idem(n: int) -> int:
    return n


@app.task(name="bench.ping")
def ping(n: int) -> int:
    """One Redis round trip on the lock client: the unit the lock overhead is made of."""
    get_redis(get_config(app).redis_url).ping()
    return n


@app.task(name="bench.tp_bare")
def tp_bare(n: int) -> int:
    return n


@app.task(name="bench.tp_locked")
@overlap_lock(lambda n: f"tp:{n % 100}", ttl=30, retry_after=0.05, jitter=0.05)
def tp_locked(n: int) -> int:
    return n
