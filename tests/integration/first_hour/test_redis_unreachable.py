"""Redis unreachable (issue 21, item 8): locked tasks back off instead of spinning, and the
``celery safe-time`` commands print one line naming the setting, the masked URL and the cause.

The lock Redis is a closed port on loopback (``free_port()``: bound, then released); the broker is
the test's real Redis, so messages still flow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from celery import Celery

from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import free_port

pytestmark = pytest.mark.integration

REQUEUED = re.compile(r"re-queueing (?P<task>\S+) in (?P<countdown>[\d.]+)s \(Redis unreachable for (?P<age>[\d.]+)s\)")


def _closed_redis(password: str = "") -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{free_port()}/0"


def test_locked_task_backs_off_while_redis_is_down(processes: ProcessManager, make_app: Callable[..., Celery]) -> None:
    conf = json.dumps({"safe_time_redis_url": _closed_redis()})
    worker = processes.worker("tests.apps.locks_app", env={"SAFE_TIME_TEST_APP_CONF": conf}, concurrency=1)
    client = make_app()
    # locks.retrier: retry_after=1, jitter=0.5. Before: every 1-1.5 s, forever.
    task_id = client.send_task("locks.retrier", kwargs={"key": "down"}).id

    def requeues() -> list[tuple[float, float]]:
        found = [m for m in REQUEUED.finditer(worker.log()) if m["task"] == task_id]
        return [(float(m["age"]), float(m["countdown"])) for m in found]

    wait_for(lambda: len(requeues()) >= 7, timeout=120, message="seven outage re-queues")
    seen = requeues()[:7]
    ages = [age for age, _ in seen]
    assert ages[0] == 0.0
    assert ages == sorted(ages), seen  # one outage, carried from copy to copy
    for age, countdown in seen:
        wait = max(1.0, age / 2)  # retry_after at first, then half the outage so far
        assert wait - 0.11 <= countdown <= wait + 0.5 + 0.11, seen  # plus jitter; the log rounds to 0.1
    assert seen[-1][1] >= 3.0  # growing: before, every re-queue waited 1 to 1.5 s
    assert "(Redis redis://127.0.0.1:" in worker.log()
    assert ", safe_time_redis_url): Error 111" in worker.log()  # the worker's warning names the setting


@pytest.mark.parametrize("command", [["locks", "list"], ["beat", "list"], ["status", "--probe", "beat"]])
def test_commands_print_one_line_naming_the_setting(processes: ProcessManager, command: list[str]) -> None:
    url = _closed_redis(password="s3cret")
    conf = json.dumps({"safe_time_redis_url": url})
    result = processes.command(
        "tests.apps.basic", "safe-time", *command, env={"SAFE_TIME_TEST_APP_CONF": conf}, timeout=60
    )
    assert result.returncode != 0
    if command[0] == "status":
        assert "Traceback" not in result.stderr  # probes report their own verdict lines
        return
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    masked = url.replace("s3cret", "***")
    assert lines[0].startswith(f"error: cannot reach Redis at {masked} (safe_time_redis_url): "), lines[0]
    assert "Connection refused" in lines[0]
    assert "s3cret" not in result.stderr + result.stdout


def test_delays_list_with_the_store_down_prints_one_line(processes: ProcessManager) -> None:
    store = f"postgresql+psycopg://app:s3cret@127.0.0.1:{free_port()}/app"
    result = processes.command(
        "tests.apps.basic", "safe-time", "delays", "list", env={"SAFE_TIME_TEST_STORE_URL": store}, timeout=60
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: safe_time_store_url: store postgresql+psycopg://app:***@127.0.0.1:"), lines[0]
    assert "s3cret" not in result.stderr
