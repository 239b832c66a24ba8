"""The SQL store's database driver is imported in the worker's main process, before the pool forks."""

from __future__ import annotations

import types

import pytest
from celery import Celery

from celery_safe_time.delays import backends
from celery_safe_time.delays.backends import sql


def test_load_driver_imports_the_dbapi_of_the_url_without_connecting() -> None:
    assert sql.load_driver("sqlite:///nowhere/never-created.sqlite3").__name__.startswith("sqlite3")
    assert sql.load_driver("postgresql://nobody@127.0.0.1:1/none").__name__ == "psycopg"


@pytest.mark.parametrize(
    ("url", "loaded"),
    [("postgresql://nobody@127.0.0.1:1/none", True), ("django", False), ("memory://", False)],
)
def test_worker_init_loads_the_driver_of_a_sql_store(monkeypatch: pytest.MonkeyPatch, url: str, loaded: bool) -> None:
    calls: list[str] = []
    monkeypatch.setattr(sql, "load_driver", calls.append)
    app = Celery("driver", set_as_current=False)
    app.conf.update(broker_url="redis://127.0.0.1:1/0", safe_time_store_url=url)
    backends._load_store_driver(sender=types.SimpleNamespace(app=app))
    assert calls == ([url] if loaded else [])


def test_a_driver_that_cannot_load_does_not_stop_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(url: str) -> None:
        raise ImportError("no module named 'MySQLdb'")

    monkeypatch.setattr(sql, "load_driver", missing)
    app = Celery("driver", set_as_current=False)
    app.conf.update(broker_url="redis://127.0.0.1:1/0", safe_time_store_url="mysql+mysqldb://nobody@127.0.0.1:1/none")
    backends._load_store_driver(sender=types.SimpleNamespace(app=app))  # reported by the store on first use
    backends._load_store_driver(sender=None)
