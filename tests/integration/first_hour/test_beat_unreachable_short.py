"""Issue 40, trap 7: beat's clear CRITICAL for an unreachable Redis was followed by ~160 lines of
traceback (Celery's CRITICAL with the frames, then the uncaught exception again, with the driver's
frames under it). One of the package's own errors now ends the beat in a few lines."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import ProcessManager
from tests.helpers.services import free_port

pytestmark = pytest.mark.integration


def test_beat_with_an_unreachable_redis_ends_in_a_few_lines(processes: ProcessManager) -> None:
    conf = {"safe_time_redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    result = processes.command(
        "tests.apps.basic",
        "beat",
        "-S",
        "celery_safe_time.beat.scheduler:SafeScheduler",
        "-l",
        "info",
        env={"SAFE_TIME_TEST_APP_CONF": json.dumps(conf)},
        timeout=90,
    )
    assert result.returncode != 0
    err = result.stderr
    assert "CRITICAL" in err, err
    assert "is unreachable at startup" in err, err
    assert "Traceback" not in err, err
    after = err[err.index("CRITICAL") :].splitlines()
    assert len(after) <= 4, "\n".join(after)
