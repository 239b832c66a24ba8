"""A beat that dies at startup logs its traceback as one record, not one WARNING line per token (issue 21, item 9).

The app here skips ``install()`` (which now refuses a bad ``timezone``), so beat still reaches the
crash the issue saw: Celery's default ``celery.backend_cleanup`` entry asking for ``app.now()``
and raising ``ZoneInfoNotFoundError``.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.processes import ProcessManager

pytestmark = pytest.mark.integration

RECORD = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+: (?P<level>[A-Z]+)/MainProcess\] ?(?P<text>.*)$")


def test_beat_startup_crash_is_a_few_records(processes: ProcessManager) -> None:
    result = processes.command(
        "tests.apps.basic",
        "beat",
        "-S",
        "celery_safe_time.beat.scheduler:SafeScheduler",
        "-l",
        "info",
        # No result backend, as in a first app: Celery then adds its backend_cleanup entry itself,
        # and building it asks for the app's time zone.
        env={"SAFE_TIME_TEST_APP_CONF": json.dumps({"timezone": "Europe/Lodnon", "result_backend": None})},
        timeout=60,
    )
    assert result.returncode != 0
    records = [m for m in map(RECORD.match, result.stderr.splitlines()) if m]
    assert any(m["level"] == "CRITICAL" and "ZoneInfoNotFoundError" in m["text"] for m in records), result.stderr
    warnings = [m for m in records if m["level"] == "WARNING"]
    # Before: 1,391 WARNING records, most of them a single "^" or blank. Now the uncaught exception
    # is one record whose text starts the traceback (its frames follow on continuation lines).
    assert len(records) < 10, f"{len(records)} records:\n{result.stderr[-3000:]}"
    tracebacks = [m for m in warnings if m["text"].startswith("Traceback (most recent call last):")]
    assert len(tracebacks) == 1
    assert not [m for m in warnings if len(m["text"].strip()) <= 2]
