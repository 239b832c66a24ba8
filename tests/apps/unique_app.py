"""Unique tasks (issue 17) that record every body start and end in Redis.

:func:`define` adds the tasks to an app, so the worker (this module, configured from the
``SAFE_TIME_TEST_*`` env) and the test's client app have the very same ``unique=`` options: the key
is taken on the caller's side. Starts go to ``test:unique:starts``, ends to ``test:unique:runs`` (JSON:
name, task id, retries, outcome, at). ``SAFE_TIME_TEST_UNIQUE_TTL`` sets ``unique_ttl`` (default 30).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Reject

from celery_safe_time import SafeTask, overlap_lock

STARTS = "test:unique:starts"
RUNS = "test:unique:runs"


def define(app: Celery, records: redis.Redis, ttl: float) -> dict[str, Task]:
    def note(name: str, list_key: str, request: Any, **extra: Any) -> None:
        entry = {"name": name, "task_id": request.id, "retries": request.retries, "at": time.time(), **extra}
        records.rpush(list_key, json.dumps({**entry, "hostname": request.hostname}))

    @app.task(shared=False, base=SafeTask, bind=True, name="unique.export", unique="export:{user_id}", unique_ttl=ttl)
    def export(self: Task, user_id: int, seconds: float = 0.5) -> int:
        note("export", STARTS, self.request)
        time.sleep(seconds)
        note("export", RUNS, self.request, outcome="ok")
        return user_id

    @app.task(
        shared=False,
        base=SafeTask,
        bind=True,
        name="unique.early",
        unique="early:{user_id}",
        unique_until="executing",
        unique_ttl=ttl,
    )
    def early(self: Task, user_id: int, seconds: float = 2.0) -> int:
        note("early", STARTS, self.request)
        time.sleep(seconds)
        return user_id

    @app.task(
        shared=False,
        base=SafeTask,
        bind=True,
        name="unique.window",
        unique="window:{user_id}",
        unique_until="expired",
        unique_ttl=ttl,
    )
    def window(self: Task, user_id: int) -> int:
        note("window", STARTS, self.request)
        return user_id

    @app.task(
        shared=False,
        base=SafeTask,
        bind=True,
        name="unique.flaky",
        unique="flaky:{user_id}",
        unique_ttl=ttl,
        max_retries=5,
    )
    def flaky(self: Task, user_id: int, fails: int = 2, countdown: float = 1.0) -> int:
        note("flaky", STARTS, self.request)
        if self.request.retries < fails:
            raise self.retry(countdown=countdown)
        note("flaky", RUNS, self.request, outcome="ok")
        return self.request.retries

    @app.task(shared=False, base=SafeTask, bind=True, name="unique.failing", unique="failing:{user_id}", unique_ttl=ttl)
    def failing(self: Task, user_id: int) -> None:
        note("failing", STARTS, self.request)
        raise ValueError(f"failing {user_id}")

    @app.task(
        shared=False, base=SafeTask, bind=True, name="unique.rejecting", unique="rejecting:{user_id}", unique_ttl=ttl
    )
    def rejecting(self: Task, user_id: int) -> None:
        note("rejecting", STARTS, self.request)
        raise Reject("not today", requeue=False)

    @app.task(
        shared=False,
        base=SafeTask,
        bind=True,
        name="unique.limited",
        unique="limited:{user_id}",
        unique_ttl=ttl,
        time_limit=1.5,
    )
    def limited(self: Task, user_id: int, seconds: float = 30.0) -> None:
        note("limited", STARTS, self.request)
        time.sleep(seconds)

    @app.task(shared=False, base=SafeTask, name="unique.strict", unique="strict:{user_id}", unique_on_conflict="raise")
    def strict(user_id: int) -> int:
        return user_id

    # "until and while executing": queued once (unique, freed at the start) and never two runs at once
    # (the overlap lock: a copy queued while one runs waits for it).
    @app.task(
        shared=False,
        base=SafeTask,
        bind=True,
        name="unique.guarded",
        unique="guarded:{user_id}",
        unique_until="executing",
        unique_ttl=ttl,
    )
    @overlap_lock("guarded:{user_id}", retry_after=0.5)
    def guarded(self: Task, user_id: int, seconds: float = 2.0) -> int:
        note("guarded", STARTS, self.request)
        time.sleep(seconds)
        note("guarded", RUNS, self.request, outcome="ok")
        return user_id

    found = (export, early, window, flaky, failing, rejecting, limited, strict, guarded)
    return {t.name.split(".", 1)[1]: t for t in found}


def _records_client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("SAFE_TIME_TEST_REDIS_URL") or os.environ["SAFE_TIME_TEST_BROKER_URL"])


if os.environ.get("SAFE_TIME_TEST_BROKER_URL"):
    from tests.apps.settings import configure

    app = configure(Celery("unique_app"))
    tasks = define(app, _records_client(), float(os.environ.get("SAFE_TIME_TEST_UNIQUE_TTL", "30")))
