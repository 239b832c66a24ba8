"""The real ``celery`` command warns about a misspelt ``safe_time_*`` setting at startup (issue 21, item 6)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import ProcessManager

pytestmark = pytest.mark.integration


def test_celery_command_names_the_closest_key(processes: ProcessManager) -> None:
    conf = json.dumps({"safe_time_beat_leese": 12})
    result = processes.command(
        "tests.apps.basic", "safe-time", "beat", "list", env={"SAFE_TIME_TEST_APP_CONF": conf}, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "unknown setting 'safe_time_beat_leese' is ignored: did you mean 'safe_time_beat_lease'?" in result.stderr
