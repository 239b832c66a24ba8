"""A plain app with a task that records each run in Redis (list ``test:runs``)."""

from __future__ import annotations

import json
import os
import socket
import time

import redis
from celery import Celery
from celery.app.task import Context

from tests.apps.settings import configure

app = configure(Celery("basic"))
# Runs are recorded in Redis: the broker's, or SAFE_TIME_TEST_RECORD_URL's when the broker is RabbitMQ.
_redis = redis.Redis.from_url(os.environ.get("SAFE_TIME_TEST_RECORD_URL") or os.environ["SAFE_TIME_TEST_BROKER_URL"])


def record_run(request: Context, label: str, sleep: float = 0.0) -> str:
    """Runs for ``sleep`` seconds, then records the run of ``request`` (``test:runs``: label, times,
    process, and the task's ``safe_time`` headers, the slot's among them); what ``tests.record`` and
    the other apps' recording tasks run."""
    started = time.time()
    if sleep:
        time.sleep(sleep)
    _redis.rpush(
        "test:runs",
        json.dumps(
            {
                "label": label,
                "task_id": request.id,
                "started": started,
                "finished": time.time(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "hostname": request.hostname,
                "headers": {k: v for k, v in (request.headers or {}).items() if k.startswith("safe_time")},
            }
        ),
    )
    return label


@app.task(bind=True, name="tests.record")
def record(self, label: str = "", sleep: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    return record_run(self.request, label, sleep)
