"""The README's plain quick start (proj.py exactly as shown, URLs pointed at the test services),
driven with real ``celery`` commands, worker and beat processes (issue 21, items 2, 10, 11)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.helpers import readme

pytestmark = pytest.mark.integration

TASKS = """

@app.task(name="proj.remind")
def remind(user_id):
    return user_id
"""

STORE_ROW = """
from proj import remind
print(remind.apply_async((7,), countdown=3600).id)
"""

NOT_INSTALLED = "celery_safe_time.install(app) was not called on app 'proj'"


def _project(tmp_path: Path, redis_url: str, **kwargs: str) -> Path:
    directory = tmp_path / "proj"
    directory.mkdir()
    store_url = f"sqlite:///{directory / 'store.sqlite3'}"
    return readme.build_plain_project(directory, broker_url=redis_url, store_url=store_url, extra=TASKS, **kwargs)


def _ok(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stdout + result.stderr
    return str(result.stdout)


def _wait_for(log: Path, pattern: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{pattern!r} not in {log}:\n{log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.2)


def test_delays_cancel_of_an_unknown_id_says_no_such_delay_and_list_has_a_header(
    tmp_path: Path, redis_url: str
) -> None:
    project = _project(tmp_path, redis_url)
    task_id = _ok(readme.python(project, STORE_ROW)).split()[-1]

    missing = readme.celery(project, "safe-time", "delays", "cancel", "no-such-id")
    assert missing.returncode == 1
    assert "no-such-id: no such delay" in missing.stderr

    listing = _ok(readme.celery(project, "safe-time", "delays", "list")).splitlines()
    assert listing[0].split() == ["ID", "STATUS", "DUE", "AT", "TASK", "ATTEMPTS", "STARTS", "OUTCOME"]
    assert listing[1].split()[:2] == [task_id, "pending"]
    assert listing[-1] == "1 row(s)"

    _ok(readme.celery(project, "safe-time", "delays", "cancel", task_id))
    again = readme.celery(project, "safe-time", "delays", "cancel", task_id)
    assert again.returncode == 1
    assert f"{task_id}: cancelled, not cancellable, unchanged" in again.stderr


def test_forgetting_install_is_said_by_the_store_call_beat_and_check(tmp_path: Path, redis_url: str) -> None:
    project = _project(tmp_path, redis_url)
    code = (project / "proj.py").read_text()
    (project / "proj.py").write_text(code.replace(readme.README_INSTALL, "# " + readme.README_INSTALL))

    check = json.loads(readme.celery(project, "safe-time", "check", "--json").stdout)
    sweep = next(c for c in check["checks"] if c["name"] == "sweep")
    assert sweep["status"] == "warn"
    assert NOT_INSTALLED in sweep["detail"]

    stored = readme.python(project, STORE_ROW)
    assert stored.returncode == 0, stored.stderr
    assert NOT_INSTALLED in stored.stderr

    text = _ok(readme.celery(project, "safe-time", "check"))
    assert re.search(r"WARN\s+sweep\s+" + re.escape(NOT_INSTALLED) + r".*\(1 stored delays pending\)", text), text

    log = tmp_path / "beat.log"
    beat = readme.start(project, log, "beat", "-S", "celery_safe_time.SafeScheduler", "-l", "info")
    try:
        _wait_for(log, r"ERROR/MainProcess\] beat: " + re.escape(NOT_INSTALLED))
    finally:
        readme.stop(beat)


def test_the_installed_quick_start_passes_the_sweep_check(tmp_path: Path, redis_url: str) -> None:
    project = _project(tmp_path, redis_url)
    stored = readme.python(project, STORE_ROW)
    assert "install(app)" not in stored.stderr
    check = json.loads(readme.celery(project, "safe-time", "check", "--json").stdout)
    assert next(c for c in check["checks"] if c["name"] == "sweep")["status"] == "ok"


def test_an_idle_sweep_logs_at_debug_in_beat_and_worker(tmp_path: Path, redis_url: str) -> None:
    project = _project(tmp_path, redis_url, before_install="app.conf.safe_time_sweep_interval = 1")
    beat_log, worker_log = tmp_path / "beat.log", tmp_path / "worker.log"
    worker = readme.start(project, worker_log, "worker", "-P", "solo", "-l", "info")
    beat = readme.start(project, beat_log, "beat", "-S", "celery_safe_time.SafeScheduler", "-l", "debug")
    try:
        _wait_for(worker_log, r"ready\.")
        # beat at DEBUG shows the sweeps it sends; let several idle ones run on the worker
        for _ in range(4):
            _wait_for(beat_log, r"DEBUG/MainProcess\] beat: sending due task celery_safe_time\.sweep")
        time.sleep(4)
        task_id = _ok(readme.python(project, STORE_ROW)).split()[-1]
        _ok(readme.celery(project, "safe-time", "delays", "reschedule", task_id, "--countdown", "0"))
        _wait_for(worker_log, re.escape(f"Task proj.remind[{task_id}] succeeded"))
    finally:
        readme.stop(beat)
        readme.stop(worker)
    beat_text, worker_text = beat_log.read_text(), worker_log.read_text()
    assert len(re.findall(r"DEBUG/MainProcess\] beat: sending due task celery_safe_time\.sweep", beat_text)) >= 4
    assert not re.search(r"INFO/MainProcess\].*celery_safe_time\.sweep", beat_text), beat_text
    sweep_lines = [line for line in worker_text.splitlines() if "celery_safe_time.sweep[" in line]
    # Only the sweep that published the row: its "succeeded" line with claimed 1 (and its own summary line).
    assert len(sweep_lines) == 1, worker_text
    assert "'claimed': 1" in sweep_lines[0]
    assert "sweep: 1 claimed, 1 sent" in worker_text
