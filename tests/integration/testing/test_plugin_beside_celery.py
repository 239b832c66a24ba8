"""The plugin in a user's own pytest run: loaded by its pytest11 entry point, beside Celery's own
fixtures (``celery_app``, ``celery_worker``), running stored delays eagerly and through a real worker.

The project's setup.cfg disables Celery's plugin (``-p no:celery``), so this runs pytest in a
subprocess on a throwaway project with its own ini file, as a user's suite would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

USER_TESTS = textwrap.dedent(
    """
    import threading
    from datetime import timedelta

    import pytest

    from celery_safe_time import SafeTask, overlap_lock
    from celery_safe_time.testing import assert_stored, run_due, stored_delays

    DAY = 86400
    RAN = []


    @pytest.fixture(scope="session")
    def celery_config():
        return {"broker_url": "memory://", "result_backend": "cache+memory://"}


    @pytest.fixture
    def safe_time_app(celery_app):
        return celery_app  # the plugin under Celery's own app fixture


    @pytest.fixture
    def tasks(celery_app):
        @celery_app.task(base=SafeTask, name="user.remind", bind=True)
        @overlap_lock("remind:{user_id}")
        def remind(self, user_id):
            RAN.append((user_id, threading.current_thread().name))
            return user_id * 2

        return remind


    def test_eager_beside_celery_app(celery_app, tasks, safe_time):
        RAN.clear()
        tasks.apply_async((21,), countdown=14 * DAY)
        assert_stored(tasks, args=(21,), due_within=timedelta(days=14, minutes=1))
        results = run_due(advance=timedelta(days=14, minutes=1))
        assert [r.result for r in results] == [42]
        assert stored_delays() == []


    def test_through_the_celery_worker_fixture(celery_app, tasks, celery_worker, safe_time):
        RAN.clear()
        celery_worker.reload()  # tasks defined after the worker started, as Celery's docs say
        tasks.apply_async((1,), countdown=3 * DAY)
        tasks.apply_async((2,), countdown=14 * DAY)
        results = safe_time.run_due(advance=timedelta(days=15), worker=celery_worker)
        assert [r.state for r in results] == ["SUCCEEDED", "SUCCEEDED"]
        assert [user for user, _ in RAN] == [1, 2]
        assert all(thread != "MainThread" for _, thread in RAN), RAN  # on the worker's thread
        assert celery_app.AsyncResult(results[0].id).get(timeout=10) == 2
    """
)

DEFAULT_APP_TESTS = textwrap.dedent(
    """
    from datetime import timedelta

    from celery import shared_task


    @shared_task(name="user.shared")
    def shared(x):
        return x + 1


    def test_default_app_with_a_real_worker_started_by_run_due(safe_time):
        assert shared.app is safe_time.app  # @shared_task binds to the fixture's current app
        shared.apply_async((1,), countdown=7 * 86400)
        results = safe_time.run_due(advance=timedelta(days=8), worker=True)
        assert [r.state for r in results] == ["SUCCEEDED"]
    """
)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p celery.contrib.pytest\n")
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "test_default_app.py").write_text(DEFAULT_APP_TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DJANGO_"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_users_suite_runs_the_plugin_beside_celerys_fixtures_eagerly_and_on_workers(tmp_path: Path) -> None:
    result = _run(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "3 passed" in output, output[-3000:]
