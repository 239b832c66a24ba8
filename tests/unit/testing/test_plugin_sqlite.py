"""celery_safe_time.testing with the temporary SQLite store: ``safe_time_sqlite`` / ``store="sqlite"``.

The rows go through the production SQL store into a real SQLite file (read back here with
``sqlite3``), the test clock moves them due, and the file is gone when the block ends.
"""

from __future__ import annotations

import sqlite3
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery

from celery_safe_time.constants import DELAY_TABLE
from celery_safe_time.delays.backends import get_store
from celery_safe_time.testing import SafeTimeTesting, TestSQLiteStore, assert_stored, run_due, safe_time_testing

DAY = 86400


def _file_rows(store: TestSQLiteStore) -> list[tuple[str, str]]:
    with sqlite3.connect(Path(store.directory) / "delays.sqlite3") as conn:
        return list(conn.execute(f"SELECT task, status FROM {DELAY_TABLE} ORDER BY due_at"))


def test_the_sqlite_fixture_stores_rows_in_a_file_and_runs_them_on_the_test_clock(
    safe_time_sqlite: SafeTimeTesting,
) -> None:
    app = safe_time_sqlite.app
    store = get_store(app)
    assert isinstance(store, TestSQLiteStore)
    assert store.url.startswith("sqlite:///")
    ran: list[int] = []

    @app.task(name="sqlite.remind")
    def remind(user_id: int) -> int:
        ran.append(user_id)
        return user_id * 2

    remind.apply_async((1,), countdown=14 * DAY)
    remind.apply_async((2,), countdown=3 * DAY)
    assert _file_rows(store) == [("sqlite.remind", "pending"), ("sqlite.remind", "pending")]
    assert_stored(remind, args=(1,), due_after=timedelta(days=13), due_within=timedelta(days=14, minutes=1))

    assert run_due(advance=timedelta(days=2)) == []
    results = safe_time_sqlite.run_due(advance=timedelta(days=12, minutes=1))
    assert [(r.state, r.result) for r in results] == [("SUCCESS", 4), ("SUCCESS", 2)]
    assert ran == [2, 1]
    assert _file_rows(store) == [("sqlite.remind", "finished"), ("sqlite.remind", "finished")]
    assert safe_time_sqlite.stored_delays() == []


def test_a_real_worker_runs_the_sqlite_stored_rows(safe_time_sqlite: SafeTimeTesting) -> None:
    app = safe_time_sqlite.app
    threads: list[str] = []

    @app.task(name="sqlite.on_worker")
    def on_worker(x: int) -> int:
        threads.append(threading.current_thread().name)
        return x

    on_worker.apply_async((7,), countdown=7 * DAY)
    results = safe_time_sqlite.run_due(advance=timedelta(days=8), worker=True)
    assert [r.state for r in results] == ["SUCCEEDED"]  # the delivery record in the SQLite row says so
    assert threads
    assert all(name != "MainThread" for name in threads)


def test_store_sqlite_through_the_options_and_the_file_is_removed_afterwards() -> None:
    app = Celery("sqlite-option", broker="memory://", task_cls="celery_safe_time:SafeTask", set_as_current=False)

    @app.task(name="sqlite.later")
    def later() -> None:
        pass

    with safe_time_testing(app, store="sqlite") as handle:
        later.apply_async(countdown=DAY)
        handle.assert_stored(later)
        directory = Path(handle.store.directory)  # type: ignore[union-attr]
        assert (directory / "delays.sqlite3").exists()
    assert not directory.exists()
    with pytest.raises(ValueError, match="'memory' or 'sqlite'"), safe_time_testing(app, store="redis"):  # type: ignore[arg-type]
        pass
