"""The baseline: the same jobs on plain Celery (no celery-safe-time), run side by side in the demo.

Runs are recorded in Redis lists so the demo can count what plain Celery did (on Redis or RabbitMQ).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import redis
from celery import Celery

BROKER = os.environ.get("DEMO_PLAIN_BROKER_URL", "redis://127.0.0.1:6379/0")
#: Where the runs are counted: the broker itself on Redis, a Redis beside it on RabbitMQ.
RECORD_URL = os.environ.get("DEMO_PLAIN_RECORD_URL", BROKER)

# set_as_current=False: otherwise shared_task proxies in the same process would bind to this app.
app = Celery("demo_plain", broker=BROKER, set_as_current=False)
app.conf.update(
    timezone="UTC",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("DEMO_PLAIN_VISIBILITY_TIMEOUT", 3600)),
        # kombu sweeps unacked messages every ~100 s by default; the demo compresses time,
        # so it sweeps every second (what hours of a real deployment would show).
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    beat_schedule={
        "monthly-invoices": {
            "task": "plain.run_invoices",
            "schedule": timedelta(seconds=float(os.environ.get("DEMO_INVOICE_EVERY", 30 * 86400))),
        }
    },
)
_redis = redis.Redis.from_url(RECORD_URL)


@app.task(name="plain.run_invoices")
def run_invoices() -> None:
    _redis.rpush("plain:invoice_runs", json.dumps({"at": time.time()}))


@app.task(name="plain.trial_ending_email", bind=True)
def trial_ending_email(self, tenant_id: int) -> None:  # type: ignore[no-untyped-def]
    _redis.rpush("plain:trial_emails", json.dumps({"tenant": tenant_id, "task_id": self.request.id, "at": time.time()}))
