"""Tasks of the durable-delay tests, defined on any app (the worker's and the test's own)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Reject

from celery_safe_time import SafeTask, overlap_lock
from celery_safe_time import constants as C


def define_tasks(app: Celery) -> dict[str, Task]:
    """Register the test tasks on ``app``; each run is recorded in Redis list ``test:runs`` (in
    ``SAFE_TIME_TEST_RECORD_URL``, default the broker: a RabbitMQ broker needs it set)."""
    client: list[redis.Redis] = []

    def _redis() -> redis.Redis:
        if not client:
            client.append(redis.Redis.from_url(os.environ.get("SAFE_TIME_TEST_RECORD_URL") or app.conf.broker_url))
        return client[0]

    def _record(task: Any, label: str) -> str:
        headers = task.request.headers or {}
        delivery = task.request.delivery_info or {}
        _redis().rpush(
            "test:runs",
            json.dumps(
                {
                    "label": label,
                    "task": task.name,
                    "task_id": task.request.id,
                    "started": time.time(),
                    "retries": task.request.retries,
                    "stored_due": headers.get(C.HEADER_STORED),
                    "hostname": task.request.hostname,
                    "routing_key": delivery.get("routing_key"),
                    "priority": delivery.get("priority"),
                    "custom": headers.get("x_custom"),
                    "parent_id": task.request.parent_id,
                    "root_id": task.request.root_id,
                }
            ),
        )
        return label

    @app.task(bind=True, base=SafeTask, name="tests.delays.record", shared=False)
    def record(self: Any, label: str = "") -> str:
        return _record(self, label)

    @app.task(bind=True, name="tests.delays.plain_record", shared=False)
    def plain_record(self: Any, label: str = "") -> str:
        return _record(self, label)

    @app.task(bind=True, base=SafeTask, name="tests.delays.retry_once", max_retries=3, shared=False)
    def retry_once(self: Any, label: str = "", countdown: float = 0) -> str:
        _record(self, label)
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return label

    @app.task(bind=True, base=SafeTask, name="tests.delays.add", shared=False)
    def add(self: Any, x: int, y: int) -> int:
        _record(self, f"add:{x}+{y}")
        return x + y

    def _end(task: Any, label: str, seconds: float) -> str:
        time.sleep(seconds)
        _redis().rpush("test:ends", json.dumps({"task_id": task.request.id, "ended": time.time(), "pid": os.getpid()}))
        return label

    def _slow(task: Any, label: str, seconds: float) -> str:
        _record(task, label)
        return _end(task, label, seconds)

    @app.task(bind=True, base=SafeTask, name="tests.delays.slow", acks_late=True, shared=False)
    def slow(self: Any, label: str = "", seconds: float = 3.0) -> str:
        """acks_late: killed mid-run, it must run again (at least once), never beside itself."""
        return _slow(self, label, seconds)

    @app.task(bind=True, base=SafeTask, name="tests.delays.slow_once", acks_late=False, shared=False)
    def slow_once(self: Any, label: str = "", seconds: float = 3.0) -> str:
        """Acked on receipt: killed mid-run, it is not run again (at most once) and counts as interrupted."""
        return _slow(self, label, seconds)

    @app.task(bind=True, base=SafeTask, name="tests.delays.locked_slow", shared=False)
    @overlap_lock("delivery-lock:{key}", retry_after=2, jitter=0.2)
    def locked_slow(self: Any, key: str, label: str = "", seconds: float = 0.0) -> str:
        """Re-queued on a lock conflict after 2 s: beyond a 1 s delay threshold, through the store."""
        return _slow(self, label, seconds)

    def _first_attempt(task: Any) -> bool:
        return int(_redis().incr(f"test:attempts:{task.request.id}")) == 1

    @app.task(bind=True, base=SafeTask, name="tests.delays.reject_once", acks_late=True, shared=False)
    def reject_once(self: Any, label: str = "", seconds: float = 0.0) -> str:
        """Gives its message back to the broker (``Reject(requeue=True)``) on its first run."""
        _record(self, label)
        if _first_attempt(self):
            raise Reject("not now", requeue=True)
        return _end(self, label, seconds)

    @app.task(
        bind=True,
        base=SafeTask,
        name="tests.delays.exit_once",
        acks_late=True,
        reject_on_worker_lost=True,
        shared=False,
    )
    def exit_once(self: Any, label: str = "", seconds: float = 0.0) -> str:
        """Unwinds with ``SystemExit`` on its first run: the pool child goes, the message comes back."""
        _record(self, label)
        if _first_attempt(self):
            raise SystemExit(1)
        return _end(self, label, seconds)

    @app.task(bind=True, base=SafeTask, name="tests.delays.retry_on_rerun", acks_late=True, max_retries=3, shared=False)
    def retry_on_rerun(self: Any, label: str = "", seconds: float = 4.0, countdown: float = 2.0) -> str:
        """First run: ``seconds`` long (kill it); the run started again: ``retry(countdown)``; then ends."""
        _record(self, label)
        attempt = int(_redis().incr(f"test:attempts:{self.request.id}"))
        if attempt == 1:
            time.sleep(seconds)
        elif attempt == 2:
            raise self.retry(countdown=countdown)
        return _end(self, label, 0)

    @app.task(bind=True, base=SafeTask, name="tests.delays.slow_steps", acks_late=True, shared=False)
    def slow_steps(self: Any, label: str = "", seconds: float = 3.0) -> str:
        """acks_late, its time spent in short sleeps: an interrupt (``LockLost``) ends it within 0.1 s."""
        _record(self, label)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                time.sleep(0.1)
        except BaseException as exc:
            _redis().rpush(
                "test:ends",
                json.dumps({"task_id": self.request.id, "ended": time.time(), "pid": os.getpid(), "error": repr(exc)}),
            )
            raise
        _redis().rpush("test:ends", json.dumps({"task_id": self.request.id, "ended": time.time(), "pid": os.getpid()}))
        return label

    return {
        "exit_once": exit_once,
        "retry_on_rerun": retry_on_rerun,
        "reject_once": reject_once,
        "slow_steps": slow_steps,
        "locked_slow": locked_slow,
        "record": record,
        "plain_record": plain_record,
        "retry_once": retry_once,
        "add": add,
        "slow": slow,
        "slow_once": slow_once,
    }
