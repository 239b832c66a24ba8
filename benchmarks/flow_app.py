"""Tasks for ``benchmarks.flow``: one global ``rate_limit``, Celery's per-worker ``rate_limit``, and a bare
task. Every body start is appended to ``bench:flow:starts`` as ``<kind> <epoch seconds>``; a
``rate_limit`` start also records the backend's admission time.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_safe_time import rate_limit, signals

URL = os.environ["SAFE_TIME_BENCH_BROKER_URL"]
#: The global limit per second, and Celery's per-worker one (the global one over the worker count).
GLOBAL = os.environ.get("SAFE_TIME_BENCH_FLOW_RATE", "20")
PER_WORKER = os.environ.get("SAFE_TIME_BENCH_FLOW_PER_WORKER", "10")
STARTS = "bench:flow:starts"
#: Each fan-out: ``<epoch seconds> <calls sent>``.
FANOUTS = "bench:flow:fanouts"

app = Celery("bench-flow", broker=URL, backend=URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    safe_time_redis_url=URL,
    safe_time_store_url="memory://bench-flow",
    timezone="UTC",
    task_ignore_result=True,
)
_redis = redis.Redis.from_url(URL)


def _admitted(sender: Any = None, started_at: float = 0.0, **_: Any) -> None:
    _redis.rpush(STARTS, f"admitted {started_at}")


signals.rate_limit_admitted.connect(_admitted, weak=False)


@app.task(name="flow.global")
@rate_limit("bench:global", f"{GLOBAL}/s")
def limited(n: int) -> None:
    _redis.rpush(STARTS, f"global {time.time()}")


@app.task(name="flow.celery", rate_limit=f"{PER_WORKER}/s")
def celery_limited(n: int) -> None:
    _redis.rpush(STARTS, f"celery {time.time()}")


# The beat producer (``python -m benchmarks.flow --producer beat``): one entry a second, fired by the
# leader of the SafeScheduler beats, fans out this many calls of the task being measured.
FANOUT_TASK = os.environ.get("SAFE_TIME_BENCH_FLOW_FANOUT_TASK")
FANOUT_PER_SECOND = int(os.environ.get("SAFE_TIME_BENCH_FLOW_FANOUT_PER_SECOND", "30"))
#: The fan-out task has a queue of its own (every worker consumes it too): behind the measured task's
#: backlog it would come late, and the producer would slow down with the very backlog it measures.
FANOUT_QUEUE = "flow-fanout"
app.conf.task_routes = {"flow.fanout": {"queue": FANOUT_QUEUE}}
if FANOUT_TASK:
    app.conf.beat_schedule = {
        # An entry of its own per measured task: a later phase's beats must not catch up on slots the
        # entry missed between phases.
        f"flow-fanout-{FANOUT_TASK}": {"task": "flow.fanout", "schedule": 1.0, "args": (FANOUT_TASK, FANOUT_PER_SECOND)}
    }


@app.task(name="flow.fanout")
def fanout(task: str, count: int) -> None:
    _redis.rpush(FANOUTS, f"{time.time()} {count}")
    with app.producer_or_acquire() as producer:
        for n in range(count):
            app.send_task(task, args=(n,), producer=producer)
