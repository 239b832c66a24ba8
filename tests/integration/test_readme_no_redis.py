"""The README's "Quick start: RabbitMQ + PostgreSQL, no Redis" (proj.py exactly as shown, URLs pointed
at a RabbitMQ vhost and a PostgreSQL database of the test's own), driven with the commands it lists:
``safe-time check``, a worker and a safe beat. Nothing of the project names a Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import readme, services

pytestmark = pytest.mark.integration

TASKS = """

@app.task(name="proj.remind")
def remind(user_id):
    with open(__file__ + ".runs", "a") as runs:
        runs.write(f"{user_id}\\n")
    return user_id
"""

STORE_ROW = """
from proj import remind
print(remind.apply_async((7,), countdown=3600).id)
"""


@pytest.fixture
def database_url() -> Iterator[str]:
    """A PostgreSQL database of this test's own: the project's tables (beat, locks, delays) start empty."""
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    yield db.url.replace("postgresql://", "postgresql+psycopg://", 1)
    db.drop()


def _ok(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stdout + result.stderr
    return str(result.stdout)


def test_the_no_redis_quick_start_checks_stores_and_runs_a_delay_with_no_redis(
    tmp_path: Path, amqp_url: str, database_url: str
) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    readme.build_no_redis_project(project, broker_url=amqp_url, store_url=database_url, extra=TASKS)
    assert "redis" not in (project / "proj.py").read_text().lower()

    report = json.loads(_ok(readme.celery(project, "safe-time", "check", "--json")))
    rows = {c["name"]: c for c in report["checks"]}
    assert report["status"] in ("ok", "warn"), report
    assert not [name for name in rows if "redis" in name], sorted(rows)
    assert rows["broker"]["status"] == "ok", rows["broker"]
    assert rows["coordination"]["status"] == "ok", rows["coordination"]
    assert rows["store"]["status"] == "ok", rows["store"]

    # A countdown above the threshold is stored; moved to "in 2 s" with the command the README lists.
    task_id = _ok(readme.python(project, STORE_ROW)).split()[-1]
    _ok(readme.celery(project, "safe-time", "delays", "reschedule", task_id, "--countdown", "2"))

    worker = readme.start(project, tmp_path / "worker.log", "worker", "-P", "solo", "-l", "info")
    beat = readme.start(project, tmp_path / "beat.log", "beat", "-S", "celery_safe_time.SafeScheduler", "-l", "info")
    runs = project / "proj.py.runs"
    try:
        deadline = time.monotonic() + 90
        while not (runs.exists() and runs.read_text()):
            logs = (tmp_path / "worker.log").read_text(errors="replace") + (tmp_path / "beat.log").read_text(
                errors="replace"
            )
            assert time.monotonic() < deadline, logs[-6000:]
            time.sleep(0.3)
    finally:
        readme.stop(beat)
        readme.stop(worker)
    assert runs.read_text() == "7\n"
    shown = json.loads(_ok(readme.celery(project, "safe-time", "delays", "show", task_id)))
    assert shown["outcome"] == "succeeded", shown
    beat_log = (tmp_path / "beat.log").read_text(errors="replace")
    assert "acquired the leader lease" in beat_log, beat_log[-3000:]
