"""Issue 40, trap 6: a failed stored row runs again (``delays rerun``), once, after its task is deployed.

The first sweep runs in an app that lacks the task (``tests.apps.basic``, the deploy before), so the
row is parked failed by the real sweep; the worker and the second sweep run the app that has it.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import redis

from celery_safe_time import constants as C
from tests.helpers.delays import DELAYS_APP, finished_row, fresh_sql_store, new_delay, runs
from tests.helpers.processes import ProcessManager

pytestmark = pytest.mark.integration


def test_a_failed_row_runs_once_after_rerun_and_reschedule_points_there(
    processes: ProcessManager, postgres_url: str, redis_client: redis.Redis
) -> None:
    store = fresh_sql_store(postgres_url)
    past = store.now() - timedelta(seconds=1)
    for task_id in ("r1", "r2"):
        store.insert(new_delay(task_id, past))
    store.insert(new_delay("other", past, task="tests.delays.add"))
    # One namespace for both apps: the old deploy's sweep sees the rows the new one stores.
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_store_url": postgres_url})}
    before = processes.cli("tests.apps.basic", "safe-time", "sweep", env=env)
    assert before.returncode == 0, before.stderr
    assert {store.get(i).status for i in ("r1", "r2", "other")} == {C.STATUS_FAILED}  # type: ignore[union-attr]

    moved = processes.cli(DELAYS_APP, "safe-time", "delays", "reschedule", "r1", "--countdown", "0", env=env)
    assert moved.returncode == 1
    assert "failed, not reschedulable" in moved.stderr
    assert "celery safe-time delays rerun r1" in moved.stderr

    one = processes.cli(DELAYS_APP, "safe-time", "delays", "rerun", "r1", env=env)
    assert one.returncode == 0, one.stdout + one.stderr
    assert store.get("r1").status == C.STATUS_PENDING  # type: ignore[union-attr]
    again = processes.cli(DELAYS_APP, "safe-time", "delays", "rerun", "r1", "nope", env=env)
    assert again.returncode == 1
    assert "r1: pending, not failed or expired, unchanged" in again.stderr
    assert "nope: no such delay" in again.stderr

    by_task = processes.cli(
        DELAYS_APP, "safe-time", "delays", "rerun", "--failed", "--task", "tests.delays.record", env=env
    )
    assert by_task.returncode == 0, by_task.stdout + by_task.stderr
    assert "1 failed delays rerun (task tests.delays.record)" in by_task.stdout
    assert store.get("r2").status == C.STATUS_PENDING  # type: ignore[union-attr]
    assert store.get("other").status == C.STATUS_FAILED  # type: ignore[union-attr]

    worker = processes.worker(DELAYS_APP, name="w", env=env)
    worker.wait_for_log(r"ready\.", timeout=90)
    sweep = processes.cli(DELAYS_APP, "safe-time", "sweep", env=env)
    assert sweep.returncode == 0, sweep.stderr
    for task_id in ("r1", "r2"):
        assert finished_row(store, task_id).outcome == C.OUTCOME_SUCCEEDED
    time.sleep(2)  # a second copy, if any, would have run by now
    labels = sorted(run["label"] for run in runs(redis_client))
    assert labels == ["r1", "r2"]
    store.close()
