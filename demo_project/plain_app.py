"""The baseline: the same jobs on plain Celery (no celery-safe-time), run side by side in the demo.

Runs are recorded so the demo can count what plain Celery did: in Redis lists (the broker itself on
Redis, the demo's Redis beside RabbitMQ), or, when the demo runs with no Redis at all (``make demo
COORD=postgres BROKER=amqp``), in JSON-lines files of a directory (``DEMO_PLAIN_RECORD_URL=file:///dir``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from celery import Celery

BROKER = os.environ.get("DEMO_PLAIN_BROKER_URL", "redis://127.0.0.1:6379/0")
#: Where the runs are counted: the broker itself on Redis, a Redis beside it on RabbitMQ, a directory
#: (``file:///dir``) when no Redis runs.
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
        # `make demo BROKER=sqs`: the demo's local SQS endpoint, queues apart from the safe side's
        **(
            {
                "region": "us-east-1",
                "is_secure": False,
                "queue_name_prefix": os.environ["DEMO_PLAIN_SQS_QUEUE_PREFIX"],
                "wait_time_seconds": 1,
                "polling_interval": 0.2,
            }
            if os.environ.get("DEMO_PLAIN_SQS_QUEUE_PREFIX")
            else {}
        ),
    },
    beat_schedule={
        "monthly-invoices": {
            "task": "plain.run_invoices",
            "schedule": timedelta(seconds=float(os.environ.get("DEMO_INVOICE_EVERY", 30 * 86400))),
        }
    },
)


_clients: dict[str, redis.Redis] = {}


def _client(url: str) -> redis.Redis:
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url)
    return _clients[url]


def _directory(url: str) -> Path | None:
    """The directory of a ``file:///dir`` record URL; None for a Redis URL."""
    parts = urlsplit(url)
    return Path(unquote(parts.path)) if parts.scheme == "file" else None


def record(name: str, item: dict[str, Any], url: str = RECORD_URL) -> None:
    """Append one run to the list ``name`` (a Redis list, or ``name.jsonl`` in the record directory)."""
    line = json.dumps(item)
    directory = _directory(url)
    if directory is None:
        _client(url).rpush(name, line)
        return
    # One short write in append mode: lines from the prefork children never interleave.
    with open(directory / f"{name.replace(':', '_')}.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def records(name: str, url: str = RECORD_URL) -> list[dict[str, Any]]:
    """Every run recorded under ``name`` so far, oldest first."""
    directory = _directory(url)
    if directory is None:
        return [json.loads(r) for r in _client(url).lrange(name, 0, -1)]
    path = directory / f"{name.replace(':', '_')}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@app.task(name="plain.run_invoices")
def run_invoices() -> None:
    record("plain:invoice_runs", {"at": time.time()})


@app.task(name="plain.trial_ending_email", bind=True)
def trial_ending_email(self, tenant_id: int) -> None:  # type: ignore[no-untyped-def]
    record("plain:trial_emails", {"tenant": tenant_id, "task_id": self.request.id, "at": time.time()})
