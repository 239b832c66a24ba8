"""The run history and change audit with a real ``celery beat`` and a real worker, on Redis and on
PostgreSQL coordination: runs with their outcomes filled in by the worker, their lateness, and the
audit of changes made through the public API and the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import entry_audit, entry_history, save_entry
from celery_safe_time.beat.entries import resume
from tests.helpers.beat import BEAT_APP, beat_env, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def test_runs_have_outcomes_and_lateness_and_changes_are_audited(
    processes: ProcessManager,
    redis_client: redis.Redis,
    make_app: Callable[..., Celery],
    coordination: dict[str, Any],
) -> None:
    app = make_app(**coordination)
    app.task(name="tests.record", shared=False)(_noop)
    env = beat_env({}, safe_time_beat_lease=6, **coordination)
    save_entry("ok", "tests.record", 1, args=("ok",), app=app, changed_by="api-test")
    # time.sleep("boom") raises in the task: a failed run
    save_entry("bad", "tests.record", 1, args=("bad",), kwargs={"sleep": "boom"}, app=app)
    processes.worker(BEAT_APP, env=env, name="worker")
    processes.beat(BEAT_APP, env=env, name="beat")

    def finished(name: str, outcome: str) -> list[Any]:
        return [r for r in entry_history(name, app=app) if r.outcome == outcome]

    def published_on_time() -> list[Any]:
        # slots due after the first publish: the first slot was due when the entry was saved,
        # before the beat started, so its lateness holds the beat's start-up, which a loaded
        # machine stretches
        done = finished("ok", "succeeded")
        published = [r.published_at for r in done if r.published_at is not None]
        return [r for r in done if published and r.slot > min(published)]

    wait_for(published_on_time, 40, message="a succeeded run of ok due after the first publish")
    wait_for(lambda: finished("bad", "failed"), 20, message="a failed run of bad")

    ran = {r["task_id"]: r for r in runs(redis_client, "ok")}
    succeeded = finished("ok", "succeeded")
    for run in succeeded:
        assert run.task_id in ran  # the id the worker ran it under
        assert ran[run.task_id]["headers"]["safe_time_slot"] == run.slot.isoformat()
        assert run.epoch is not None
        assert run.runtime is not None
        assert run.finished_at is not None
        assert run.published_at is not None
        assert run.finished_at >= run.published_at
        assert run.lateness == pytest.approx((run.published_at - run.slot).total_seconds(), abs=0.002)
    for run in published_on_time():
        assert run.lateness is not None
        assert 0.0 <= run.lateness < 5.0
    newest = entry_history("ok", app=app, limit=1)
    assert len(newest) == 1

    paused = processes.cli(BEAT_APP, "safe-time", "beat", "pause", "ok", "--note", "maintenance", env=env)
    assert paused.returncode == 0, paused.stderr
    resume("ok", app=app, changed_by="api-test")
    changes = entry_audit("ok", app=app)
    assert [c.action for c in changes] == ["resume", "pause", "create"]
    assert changes[0].changed_by == "api-test"
    assert changes[1].changed_by.endswith("(safe-time cli)")
    assert changes[1].old is not None
    assert changes[1].new is not None
    assert (changes[1].old["enabled"], changes[1].new["enabled"]) == (True, False)
    assert changes[1].new["paused"]["note"] == "maintenance"

    shown = processes.cli(BEAT_APP, "safe-time", "beat", "show", "ok", "--last", "3", env=env)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert [c["action"] for c in data["changes"]] == ["resume", "pause", "create"]
    assert data["runs"][0]["task_id"]
    tables = processes.cli(BEAT_APP, "safe-time", "beat", "show", "bad", "--history", env=env)
    assert tables.returncode == 0, tables.stderr
    assert "failed" in tables.stdout
    assert "last 1 change(s):" in tables.stdout
