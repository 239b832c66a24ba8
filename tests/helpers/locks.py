"""Helpers for the overlap-lock tests: start the locks app worker, read what its tasks recorded."""

from __future__ import annotations

import itertools
import json
from typing import Any

import redis
from celery import Celery

from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

APP = "tests.apps.locks_app"
RUNS = "test:locks:runs"
SIGNALS = "test:locks:signals"


def start_worker(
    processes: ProcessManager,
    *,
    name: str = "locks",
    ttl: float = 3.0,
    retry_after: float = 0.5,
    concurrency: int = 8,
    env: dict[str, str] | None = None,
) -> CeleryProcess:
    worker = processes.worker(
        APP,
        name=name,
        concurrency=concurrency,
        env={"SAFE_TIME_TEST_LOCK_TTL": str(ttl), "SAFE_TIME_TEST_RETRY_AFTER": str(retry_after), **(env or {})},
    )
    worker.wait_for_log(r"ready\.", timeout=90)
    return worker


def client_app(redis_url: str, **conf: Any) -> Celery:
    app = Celery("locks-client", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, **conf)
    return app


def runs(client: redis.Redis, name: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(RUNS, 0, -1)]
    return [r for r in found if name is None or r["name"] == name]


def signals(client: redis.Redis, signal: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(SIGNALS, 0, -1)]
    return [s for s in found if signal is None or s["signal"] == signal]


def wait_runs(client: redis.Redis, name: str, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    wait_for(lambda: len(runs(client, name)) >= count, timeout, message=f"{count} runs of {name}")
    return runs(client, name)


def overlaps(intervals: list[tuple[float, float]]) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Pairs of intervals that overlap (sorted by start)."""
    ordered = sorted(intervals)
    return [(a, b) for a, b in itertools.pairwise(ordered) if b[0] < a[1]]


def lock_fields(client: redis.Redis, key: str, prefix: str = "safe_time:") -> dict[str, str]:
    raw = client.hgetall(f"{prefix}lock:{key}")
    return {k.decode(): v.decode() for k, v in raw.items()}
