"""The README's Django quick start, built as written (``django-admin startproject`` + the README's
files, no ``django.setup()`` in celery.py), driven with the real ``celery`` command (issue 21, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import readme

pytestmark = pytest.mark.integration

SHELL_STORE = """
from proj.celery import app

@app.task(name="proj.remind")
def remind(user_id):
    return user_id

print(remind.apply_async((42,), countdown=86400).id)
"""

SHELL_ENTRY = """
from django_celery_beat.models import IntervalSchedule, PeriodicTask

every, _ = IntervalSchedule.objects.get_or_create(every=10, period=IntervalSchedule.SECONDS)
PeriodicTask.objects.create(name="report", task="proj.report", interval=every)
"""


@pytest.fixture
def project(tmp_path: Path, redis_url: str) -> Path:
    directory = readme.build_django_project(tmp_path / "site", broker_url=redis_url)
    migrated = readme.run(directory, "django", "migrate", "--settings=proj.settings")
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    return directory


def _shell(project: Path, code: str) -> str:
    result = readme.run(project, "django", "shell", "--settings=proj.settings", "-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def _ok(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "AppRegistryNotReady" not in result.stderr
    return str(result.stdout)


def test_the_readme_layout_has_no_django_setup() -> None:
    # What this file tests: the layout a user copies does not set Django up itself.
    assert "django.setup()" not in readme.readme_block("Quick start: Django")


def test_safe_time_commands_work_with_the_readme_django_layout(project: Path) -> None:
    task_id = _shell(project, SHELL_STORE).splitlines()[-1]

    status = json.loads(_ok(readme.celery(project, "safe-time", "status", "--json")))
    assert status["delays"]["pending"] == 1

    listing = _ok(readme.celery(project, "safe-time", "delays", "list"))
    assert task_id in listing
    assert "proj.remind" in listing

    shown = json.loads(_ok(readme.celery(project, "safe-time", "delays", "show", task_id)))
    assert shown["call"]["args"] == [42]

    swept = json.loads(_ok(readme.celery(project, "safe-time", "sweep")))
    assert swept["claimed"] == 0  # due tomorrow

    cancelled = _ok(readme.celery(project, "safe-time", "delays", "cancel", task_id))
    assert f"{task_id}: cancelled" in cancelled


def test_status_counts_django_celery_beat_entries(project: Path) -> None:
    _shell(project, SHELL_ENTRY)
    status = json.loads(_ok(readme.celery(project, "safe-time", "status", "--json")))
    beat = status["beat"]
    assert beat["entries_total"] == 1
    assert [entry["entry"] for entry in beat["entries"]] == ["report"]


SHELL_SWEEP_COPY = """
from django_celery_beat.models import IntervalSchedule, PeriodicTask

every, _ = IntervalSchedule.objects.get_or_create(every=10, period=IntervalSchedule.SECONDS)
PeriodicTask.objects.create(name="report", task="proj.report", interval=every)
# What SafeDatabaseScheduler writes at its start: the beat_schedule entries as rows of its table.
PeriodicTask.objects.create(name="celery_safe_time.sweep", task="celery_safe_time.sweep", interval=every)
"""


def test_beat_list_shows_django_celery_beat_rows_and_the_sweep_once(project: Path) -> None:
    # Issue 40, trap 5: beat list showed only the sweep's config entry, not the table's rows.
    _shell(project, SHELL_SWEEP_COPY)
    listing = json.loads(_ok(readme.celery(project, "safe-time", "beat", "list", "--json")))
    assert [(e["name"], e["source"]) for e in listing] == [
        ("celery_safe_time.sweep", "database"),
        ("report", "database"),
    ]
    table = _ok(readme.celery(project, "safe-time", "beat", "list"))
    names = [line.split()[0] for line in table.splitlines()[1:-1]]
    assert names == ["celery_safe_time.sweep", "report"]
    assert table.splitlines()[-1].startswith("2 entries (of ")
