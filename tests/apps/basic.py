"""A plain app with a task that records each run in Redis (list ``test:runs``)."""

from __future__ import annotations

import json
import os
import socket
import time

import redis
from celery import Celery

from tests.apps.settings import configure

app = configure(Celery("basic"))
# Runs are recorded in Redis: the broker's, or SAFE_TIME_TEST_RECORD_URL's when the broker is RabbitMQ.
_redis = redis.Redis.from_url(os.environ.get("SAFE_TIME_TEST_RECORD_URL") or os.environ["SAFE_TIME_TEST_BROKER_URL"])


@app.task(bind=True, name="tests.record")
def record(self, label: str = "", sleep: float = 0.0) -> str:  # type: ignore[no-untyped-def]
    started = time.time()
    if sleep:
        time.sleep(sleep)
    _redis.rpush(
        "test:runs",
        json.dumps(
            {
                "label": label,
                "task_id": self.request.id,
                "started": started,
                "finished": time.time(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "hostname": self.request.hostname,
                "headers": {k: v for k, v in (self.request.headers or {}).items() if k.startswith("safe_time")},
            }
        ),
    )
    return label
