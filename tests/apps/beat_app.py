"""A beat app whose schedule comes from env ``SAFE_TIME_TEST_BEAT_SCHEDULE`` (JSON).

Each entry: ``{"task": ..., "every": seconds}`` or ``{"task": ..., "cron": {crontab kwargs incl. tz}}``
plus optional ``args``, ``kwargs``, ``options``, ``jitter`` and ``catchup_window``. Uses the
``tests.record`` task of ``basic``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery_safe_time import crontab
from tests.apps.basic import app, record

__all__ = ["app", "record"]


def _entry(spec: dict[str, Any]) -> dict[str, Any]:
    entry = {k: v for k, v in spec.items() if k in ("task", "args", "kwargs", "options", "jitter", "catchup_window")}
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
