"""Helpers for the unique-task tests: a worker of ``tests.apps.unique_app``, a client app with the
same tasks, and what the tasks recorded."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from celery import Celery, Task

from tests.apps import unique_app
from tests.helpers import locks as h
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

APP = "tests.apps.unique_app"


def start_worker(
    processes: ProcessManager,
    broker_url: str,
    redis_url: str,
    *,
    ttl: float = 30.0,
    name: str = "unique",
    concurrency: int = 2,
    coordination: dict[str, Any] | None = None,
    **conf: Any,
) -> CeleryProcess:
    env = {
        **h.broker_env(broker_url, redis_url, coordination=coordination, **conf),
        "SAFE_TIME_TEST_UNIQUE_TTL": str(ttl),
    }
    worker = processes.worker(APP, name=name, concurrency=concurrency, env=env)
    worker.wait_for_log(r"ready\.", timeout=90)
    return worker


def client(
    broker_url: str,
    redis_url: str,
    sqlite_url: str,
    *,
    ttl: float = 30.0,
    coordination: dict[str, Any] | None = None,
    **conf: Any,
) -> tuple[Celery, dict[str, Task]]:
    """``coordination``: the ``coordination_conf`` fixture's settings (PostgreSQL: no Redis setting)."""
    app = Celery("unique-client", broker=broker_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        safe_time_store_url=sqlite_url,
        timezone="UTC",
        **conf,
    )
    app.conf.update(coordination or {"safe_time_redis_url": redis_url})
    tasks = unique_app.define(app, redis.Redis.from_url(redis_url), ttl)
    return app, tasks


def key_fields(client: redis.Redis, key: str, prefix: str = "safe_time:") -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(f"{prefix}unique:{key}").items()}


def wait_free(client: redis.Redis, key: str, timeout: float, prefix: str = "safe_time:") -> None:
    wait_for(lambda: not client.exists(f"{prefix}unique:{key}"), timeout, message=f"unique key {key!r} to be free")


def starts(client: redis.Redis, name: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(unique_app.STARTS, 0, -1)]
    return [s for s in found if name is None or s["name"] == name]


def runs(client: redis.Redis, name: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(unique_app.RUNS, 0, -1)]
    return [s for s in found if name is None or s["name"] == name]


def key_state(app: Celery, key: str) -> dict[str, Any]:
    """The unique ``key``'s holder and state on the app's lock backend ({} when free)."""
    from celery_safe_time.locks.backends import get_lock_backend

    info = get_lock_backend(app).unique_info(key, time.time())
    return {} if info is None else {"task_id": info.task_id, "state": info.state}


def wait_key_free(app: Celery, key: str, timeout: float) -> None:
    wait_for(lambda: not key_state(app, key), timeout, message=f"unique key {key!r} to be free")
