"""The harness itself: real worker subprocesses that can be paused, resumed and killed."""

from __future__ import annotations

import json

import pytest
import redis

from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def _runs(client: redis.Redis) -> list[dict[str, object]]:
    return [json.loads(r) for r in client.lrange("test:runs", 0, -1)]


def test_worker_subprocess_runs_tasks_and_obeys_signals(
    processes: ProcessManager, redis_client: redis.Redis, make_app
) -> None:  # type: ignore[no-untyped-def]
    worker = processes.worker("tests.apps.basic", concurrency=1, pool="solo")
    worker.wait_for_log(r"ready\.", timeout=90)
    app = make_app()
    app.send_task("tests.record", args=["first"])
    wait_for(lambda: len(_runs(redis_client)) == 1, 60, message="first run")

    worker.pause()
    app.send_task("tests.record", args=["while-paused"])
    # A stopped worker runs nothing; give it a moment to prove it.
    with pytest.raises(AssertionError):
        wait_for(lambda: len(_runs(redis_client)) == 2, 2, message="no run while paused")
    worker.resume()
    wait_for(lambda: len(_runs(redis_client)) == 2, 60, message="run after SIGCONT")

    worker.kill()
    assert not worker.alive()
    assert [r["label"] for r in _runs(redis_client)] == ["first", "while-paused"]


def test_terminate_is_graceful(processes: ProcessManager) -> None:
    worker = processes.worker("tests.apps.basic", concurrency=1, pool="solo")
    worker.wait_for_log(r"ready\.", timeout=90)
    code = worker.terminate()
    assert code == 0
