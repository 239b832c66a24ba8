"""``celery safe-time status --probe beat|sweep|store`` through the real ``celery`` command."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from celery import Celery

from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.base import NewDelay
from tests.helpers.processes import ProcessManager

pytestmark = pytest.mark.integration

APP = "tests.apps.beat_app"
CONF = {"safe_time_beat_lease": 3}


def probe(processes: ProcessManager, *args: str, conf: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({**CONF, **(conf or {})})}
    return processes.cli(APP, "safe-time", "status", *args, env=env)


def _wait_exit(processes: ProcessManager, code: int, *args: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = probe(processes, *args)
        if result.returncode == code:
            return
        assert time.monotonic() < deadline, result.stdout + result.stderr
        time.sleep(0.3)


def test_beat_probe_fails_without_a_leader_and_passes_while_one_holds_the_lease(processes: ProcessManager) -> None:
    result = probe(processes, "--probe", "beat")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no beat holds the leader lease" in result.stdout

    beat = processes.beat(APP, env={"SAFE_TIME_TEST_APP_CONF": json.dumps(CONF)})
    beat.wait_for_log("acquired the leader lease", 30)
    result = probe(processes, "--probe", "beat", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "ok"
    [check] = report["probes"]
    assert check["value"]["pid"] == beat.pid
    assert check["value"]["epoch"] >= 1
    assert 0 < check["value"]["lease_left_s"] <= 3

    beat.terminate()  # a clean shutdown deletes the lease
    _wait_exit(processes, 1, "--probe", "beat", timeout=10)


def test_beat_probe_fails_when_redis_is_unreachable(processes: ProcessManager) -> None:
    result = probe(processes, "--probe", "beat", conf={"safe_time_redis_url": "redis://:s3cret@127.0.0.1:1/0"})
    assert result.returncode == 1
    assert "unreachable" in result.stdout
    assert "s3cret" not in result.stdout + result.stderr


def test_sweep_probe_fails_when_the_oldest_due_delay_is_later_than_the_limit(
    processes: ProcessManager, make_app: Callable[..., Celery]
) -> None:
    assert probe(processes, "--probe", "sweep", "--max-lateness", "5").returncode == 0
    app = make_app()
    store = get_store(app)  # the same SQLite file the command reads (processes' store URL)
    store.insert(
        NewDelay(
            id="late-1",
            task="tests.record",
            payload=b'{"args": [], "kwargs": {}, "options": {}}',
            content_type="application/json",
            content_encoding="utf-8",
            due_at=store.now() - timedelta(seconds=30),
        )
    )
    result = probe(processes, "--probe", "sweep", "--max-lateness", "5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "late (limit 5s)" in result.stdout
    ok = probe(processes, "--probe", "sweep", "--max-lateness", "2m", "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["probes"][0]["value"]["lateness_seconds"] >= 30

    # A sweep publishes it: nothing due is late any more.
    swept = processes.cli(APP, "safe-time", "sweep", env={"SAFE_TIME_TEST_APP_CONF": json.dumps(CONF)})
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert probe(processes, "--probe", "sweep", "--max-lateness", "5").returncode == 0


def test_store_probe_fails_when_the_store_is_unreachable_and_probes_combine(processes: ProcessManager) -> None:
    assert probe(processes, "--probe", "store").returncode == 0
    down = {"safe_time_store_url": "postgresql+psycopg://app:s3cret@127.0.0.1:1/nope"}
    result = probe(processes, "--probe", "store", "--probe", "sweep", "--json", conf=down)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [(c["name"], c["status"]) for c in report["probes"]] == [("store", "fail"), ("sweep", "fail")]
    assert "s3cret" not in result.stdout + result.stderr


def test_a_bad_max_lateness_is_a_usage_error(processes: ProcessManager) -> None:
    result = probe(processes, "--probe", "sweep", "--max-lateness", "soon")
    assert result.returncode == 2
    assert "not a duration" in result.stderr


@pytest.mark.parametrize("name", ["store", "sweep"])
def test_a_failing_probe_prints_its_verdict_once_on_one_line(
    processes: ProcessManager, postgres_url: str, name: str
) -> None:
    missing = postgres_url.rsplit("/", 1)[0] + "/no_such_database_here"
    result = probe(processes, "--probe", name, conf={"safe_time_store_url": missing})
    assert result.returncode == 1, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert output.count('database "no_such_database_here" does not exist') == 1, output
    [row] = result.stdout.splitlines()
    assert row.startswith(f"FAIL  {name}  store "), row
    assert "Background on this error" not in output
