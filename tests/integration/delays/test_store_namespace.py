"""Two apps laid out as the README's plain quick start (one named billing, one shop) share one
PostgreSQL store database: each sweep, status, list and cancel sees only its own app's rows
(issue 21, item 3). Real ``celery`` commands in subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import readme
from tests.helpers.delays import fresh_sql_store

pytestmark = pytest.mark.integration

TASKS = """

@app.task(name="{name}.remind")
def remind(user_id):
    return user_id
"""

STORE_ROW = """
from proj import remind
print(remind.apply_async((7,), countdown=3600).id)
"""

STORE_UNKNOWN_TASK_ROW = """
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.base import NewDelay
from proj import app
get_store(app).insert(NewDelay("gone-1", "shop.gone", b"[[], {}, {}]", "application/json", "utf-8", countdown=-1))
"""


def _project(directory: Path, name: str, redis_url: str, store_url: str) -> Path:
    directory.mkdir()
    readme.build_plain_project(directory, broker_url=redis_url, store_url=store_url, extra=TASKS.format(name=name))
    code = (directory / "proj.py").read_text()
    assert 'Celery("proj"' in code
    (directory / "proj.py").write_text(code.replace('Celery("proj"', f'Celery("{name}"'))
    return directory


def _ok(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stdout + result.stderr
    return str(result.stdout)


def _sweep(project: Path) -> dict[str, int]:
    return dict(json.loads(_ok(readme.celery(project, "safe-time", "sweep"))))


def _pending(project: Path) -> int:
    return int(json.loads(_ok(readme.celery(project, "safe-time", "status", "--json")))["delays"]["pending"])


def test_two_apps_sharing_one_store_database_keep_to_their_own_rows(
    tmp_path: Path, redis_url: str, postgres_url: str
) -> None:
    fresh_sql_store(postgres_url).close()  # an empty table: no rows of other tests
    billing = _project(tmp_path / "billing", "billing", redis_url, postgres_url)
    shop = _project(tmp_path / "shop", "shop", redis_url, postgres_url)

    task_id = _ok(readme.python(billing, STORE_ROW)).split()[-1]
    _ok(readme.celery(billing, "safe-time", "delays", "reschedule", task_id, "--countdown", "0"))
    assert (_pending(billing), _pending(shop)) == (1, 0)
    status = json.loads(_ok(readme.celery(shop, "safe-time", "status", "--json")))
    assert status["delays"]["namespace"] == "shop"
    assert task_id in _ok(readme.celery(billing, "safe-time", "delays", "list"))
    assert task_id not in _ok(readme.celery(shop, "safe-time", "delays", "list"))
    refused = readme.celery(shop, "safe-time", "delays", "cancel", task_id)
    assert refused.returncode == 1
    assert "no such delay" in refused.stderr

    assert _sweep(shop)["claimed"] == 0  # before: claimed and marked failed, "unknown task 'billing.remind'"
    swept = _sweep(billing)
    assert (swept["claimed"], swept["sent"], swept["failed"]) == (1, 1, 0)

    # An unknown task in one's own namespace is still marked failed.
    _ok(readme.python(shop, STORE_UNKNOWN_TASK_ROW))
    assert _sweep(billing)["claimed"] == 0
    swept = _sweep(shop)
    assert (swept["claimed"], swept["failed"]) == (1, 1)
    shown = json.loads(_ok(readme.celery(shop, "safe-time", "delays", "show", "gone-1")))
    assert shown["status"] == "failed"
    assert "shop.gone" in shown["last_error"]
    assert shown["namespace"] == "shop"
