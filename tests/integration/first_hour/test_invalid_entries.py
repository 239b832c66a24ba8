"""Issue 40, trap 4: an invalid beat entry was caught only by the leader; ``check`` had no row for it
and ``beat list`` showed it enabled. Both now name it, with the reason the leader disables it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import ProcessManager

pytestmark = pytest.mark.integration

SCHEDULE = {
    "typo": {"task": "tests.record", "schedule": 10, "options": {"overlap": "sikp"}},
    "ghost": {"task": "tests.no_such_task", "schedule": 10},
    "fine": {"task": "tests.record", "schedule": 10},
}


def test_check_and_beat_list_name_each_invalid_entry(processes: ProcessManager) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"beat_schedule": SCHEDULE})}
    check = processes.command("tests.apps.basic", "safe-time", "check", env=env, timeout=60)
    rows = [line.split(None, 2) for line in check.stdout.splitlines() if line.split()[1:2] == ["entries"]]
    # The test environment names Django settings without django-celery-beat's tables: a row of its own.
    rows = [row for row in rows if not row[2].startswith("django-celery-beat rows unreadable")]
    assert [(status, detail.split(":")[0]) for status, _, detail in rows] == [("WARN", "ghost"), ("WARN", "typo")], (
        check.stdout + check.stderr
    )
    assert "unknown task 'tests.no_such_task'" in rows[0][2]
    assert "'sikp'" in rows[1][2]
    assert "is disabled" not in check.stderr  # said as rows, not also as log lines

    listing = processes.command("tests.apps.basic", "safe-time", "beat", "list", env=env, timeout=60)
    assert listing.returncode == 0, listing.stderr
    states = {line.split()[0]: line.split()[2] for line in listing.stdout.splitlines()[1:4]}
    assert states == {"fine": "enabled", "ghost": "invalid", "typo": "invalid"}, listing.stdout
    assert "invalid: typo: invalid entry: ScheduleError:" in listing.stdout
    listed = json.loads(processes.command("tests.apps.basic", "safe-time", "beat", "list", "--json", env=env).stdout)
    assert {item["name"]: item["invalid"] is not None for item in listed} == {
        "fine": False,
        "ghost": True,
        "typo": True,
    }

    status = json.loads(processes.command("tests.apps.basic", "safe-time", "status", "--json", env=env).stdout)
    invalid = status["beat"]["invalid_entries"]
    assert isinstance(invalid, dict), invalid
    assert sorted(invalid) == ["ghost", "typo"]
    assert "unknown task 'tests.no_such_task'" in invalid["ghost"]
