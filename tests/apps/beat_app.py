"""A beat app whose schedule comes from env ``SAFE_TIME_TEST_BEAT_SCHEDULE`` (JSON).

Each entry: ``{"task": ..., "every": seconds}`` or ``{"task": ..., "cron": {crontab kwargs incl. tz}}``
plus optional ``args``, ``kwargs``, ``options``, ``jitter``, ``catchup_window``, ``overlap`` and
``overlap_ttl``. Uses the ``tests.record`` task of ``basic``; ``tests.overlap_run`` records the start
and the end of each run of an entry with an overlap policy (``test:overlap:<label>``), and beat's
first publish of each of its slots.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery.signals import before_task_publish

from celery_safe_time import concurrency_limit, crontab, overlap_lock, rate_limit
from tests.apps.basic import _redis, app, record, record_run

__all__ = ["app", "overlap_run", "rated_run", "record", "stacked_run"]


def _event(label: str, event: str, task_id: Any, **extra: Any) -> None:
    _redis.rpush(f"test:overlap:{label}", json.dumps({"event": event, "task_id": task_id, "at": time.time(), **extra}))


@app.task(bind=True, name="tests.overlap_run")
def overlap_run(self, label: str, sleep: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    _event(label, "start", self.request.id, pid=os.getpid())
    outcome = "done"
    try:
        deadline = time.time() + sleep
        while time.time() < deadline:
            time.sleep(0.05)
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        _event(label, "end", self.request.id, outcome=outcome)


@app.task(bind=True, name="tests.rated_run")
@rate_limit("entry-rate:{label}", os.environ.get("SAFE_TIME_TEST_ENTRY_RATE", "1/4s"))
def rated_run(self, label: str) -> None:  # type: ignore[no-untyped-def]
    """A beat entry's task under a rate limit (issue 38): records its start and end as ``overlap_run``."""
    _event(label, "start", self.request.id, pid=os.getpid())
    _event(label, "end", self.request.id, outcome="done")


@app.task(bind=True, name="tests.stacked_run")
@overlap_lock("stacked:{label}", ttl=10, retry_after=0.2)
@concurrency_limit("stacked-all", limit=2, ttl=10, retry_after=0.2)
def stacked_run(self, label: str, sleep: float = 0.3) -> str:  # type: ignore[no-untyped-def]
    """A beat entry's task behind two gates (an overlap lock per entry, two runs at once of all
    entries): recorded as ``tests.record`` records its runs (``test:runs``, with the slot header)."""
    return record_run(self.request, label, sleep)


def _on_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Beat's publish of a slot of an entry with an overlap policy (a worker's re-queue carries
    ``safe_time_requeues`` and is not a new publish)."""
    spec = (headers or {}).get("safe_time_overlap")
    if isinstance(spec, dict) and "safe_time_requeues" not in (headers or {}):
        _event(spec["entry"], "publish", (headers or {}).get("id"))


before_task_publish.connect(_on_publish, weak=False)


def _entry(spec: dict[str, Any]) -> dict[str, Any]:
    keys = ("task", "args", "kwargs", "options", "jitter", "catchup_window", "overlap", "overlap_ttl")
    entry = {k: v for k, v in spec.items() if k in keys}
    if "cron" in spec:
        entry["schedule"] = crontab(**spec["cron"])
    elif "raw" in spec:  # deliberately broken schedules for the bad-input tests
        entry["schedule"] = spec["raw"]
    else:
        entry["schedule"] = float(spec["every"])
    return entry


app.conf.beat_schedule = {
    name: _entry(spec) for name, spec in json.loads(os.environ.get("SAFE_TIME_TEST_BEAT_SCHEDULE", "{}")).items()
}
