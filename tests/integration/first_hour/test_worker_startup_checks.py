"""A worker checks its store and coordination URLs at startup (``worker_init``): a missing driver stops
it with a short error naming the setting, the extra to install and the URL form, never "ready" first;
an unreachable backend is named in one ERROR line before "ready", and the worker starts (the backend
may answer in a moment), as Celery's worker does while its broker is away."""

from __future__ import annotations

import json

import pytest

from tests.helpers.delays import DELAYS_APP
from tests.helpers.processes import ProcessManager
from tests.helpers.services import free_port

pytestmark = pytest.mark.integration


def _failed_start(processes: ProcessManager, conf: dict[str, str]) -> str:
    worker = processes.worker(DELAYS_APP, name="w", env={"SAFE_TIME_TEST_APP_CONF": json.dumps(conf)})
    code = worker.wait(timeout=90)
    log = worker.log()
    assert code not in (None, 0), log
    assert "ready." not in log
    assert "Traceback" not in log, log
    return log


def _started_despite(processes: ProcessManager, conf: dict[str, str]) -> str:
    worker = processes.worker(DELAYS_APP, name="w", env={"SAFE_TIME_TEST_APP_CONF": json.dumps(conf)})
    worker.wait_for_log(r"ready\.", timeout=90)
    log = worker.log()
    assert worker.alive(), log
    assert "Traceback" not in log, log
    # Said before "ready", once.
    assert log.index("worker: safe_time_") < log.index("ready."), log
    assert log.count("worker: safe_time_") == 1, log
    return log


def test_an_unreachable_store_is_named_before_ready_and_the_worker_starts(processes: ProcessManager) -> None:
    url = f"postgresql://postgres:s3cret@127.0.0.1:{free_port()}/app"
    log = _started_despite(processes, {"safe_time_store_url": url})
    assert "worker: safe_time_store_url: store postgresql+psycopg://postgres:***@127.0.0.1:" in log, log
    assert "starting anyway" in log
    assert "s3cret" not in log


def test_an_unreachable_redis_is_named_before_ready_and_the_worker_starts(processes: ProcessManager) -> None:
    log = _started_despite(processes, {"safe_time_redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    assert "worker: safe_time_redis_url: redis://127.0.0.1:" in log, log
    assert "unreachable" in log


def test_a_missing_driver_names_the_extra_and_the_url_form(processes: ProcessManager, postgres_url: str) -> None:
    url = postgres_url.replace("postgresql+psycopg://", "postgresql+psycopg2://", 1)
    log = _failed_start(processes, {"safe_time_store_url": url})
    assert "worker: safe_time_store_url: the database driver for postgresql+psycopg2://" in log, log
    assert "No module named 'psycopg2'" in log
    assert "pip install 'celery-safe-time[postgres]', which brings psycopg: write the URL without '+psycopg2'" in log
