"""A fresh virtualenv with only ``pip install celery-safe-time[postgres]`` runs ``celery beat`` on Redis.

Issue 21, item 5: that install crashed at beat startup with ``No module named 'packaging'``. Slow
(it builds the package and downloads its dependencies), so it runs under ``make soak``; the fast
check of the same thing is ``tests/unit/test_install_requirements.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = """
from celery import Celery
import celery_safe_time

app = Celery("proj", broker={broker!r})
app.conf.safe_time_key_prefix = "fresh-install:"
app.conf.safe_time_store_url = {store!r}
celery_safe_time.install(app)
"""


def test_fresh_venv_with_the_postgres_extra_runs_beat(tmp_path: Path, redis_url: str, postgres_url: str) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", f"{ROOT}[postgres]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    (tmp_path / "proj.py").write_text(APP.format(broker=redis_url, store=postgres_url))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    log = tmp_path / "beat.log"
    with open(log, "wb") as out:
        beat = subprocess.Popen(
            [str(venv / "bin" / "celery"), "-A", "proj", "beat", "-S", "celery_safe_time.SafeScheduler", "-l", "info"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "acquired the leader lease" not in log.read_text():
            assert beat.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert "acquired the leader lease" in text, text[-3000:]
        assert "ModuleNotFoundError" not in text
    finally:
        beat.kill()
        beat.wait(30)
