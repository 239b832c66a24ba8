"""Fixtures and helpers for the delayed-task tests (stores, rows, the subprocess app)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from kombu import Connection

from celery_safe_time import constants as C
from celery_safe_time.delays.backends.base import DelayStore, NewDelay
from celery_safe_time.delays.backends.memory import MemoryStore
from celery_safe_time.delays.backends.sql import SQLAlchemyStore

UTC = timezone.utc
DELAYS_APP = "tests.apps.delays_app"


def new_delay(task_id: str, due_at: datetime, *, task: str = "tests.delays.record", **extra: Any) -> NewDelay:
    payload = json.dumps({"args": [task_id], "kwargs": {}, "options": {}}).encode()
    return NewDelay(
        id=task_id,
        task=task,
        payload=extra.pop("payload", payload),
        content_type=extra.pop("content_type", "application/json"),
        content_encoding=extra.pop("content_encoding", "utf-8"),
        due_at=due_at,
        **extra,
    )


def finished_row(store: DelayStore, task_id: str, timeout: float = 30.0) -> Any:
    """The row of ``task_id`` once its run has been recorded as finished.

    A task body's own record (``test:runs``/``test:ends``) is written before the worker records the
    outcome, after the body returns: reading the row at once races that write.
    """
    from tests.helpers.processes import wait_for

    def finished() -> Any:
        row = store.get(task_id)
        return row if row is not None and row.status == C.STATUS_FINISHED else None

    return wait_for(finished, timeout, message=f"the row of {task_id} to be recorded finished")


def fresh_sql_store(url: str) -> SQLAlchemyStore:
    """A SQLAlchemy store on ``url`` with an empty table."""
    store = SQLAlchemyStore(url)
    store.ensure_schema()
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {C.DELAY_TABLE}"))
    return store


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> DelayStore:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return fresh_sql_store(f"sqlite:///{tmp_path / 'contract.sqlite3'}")
    if kind == "postgresql":
        return fresh_sql_store(request.getfixturevalue("postgres_url"))
    if kind == "mysql":
        return fresh_sql_store(request.getfixturevalue("mysql_url"))
    if kind == "django":
        from celery_safe_time.contrib.django.store import DjangoStore

        return DjangoStore()
    raise ValueError(kind)


#: The Django param carries the django_db mark: pytest-django only migrates the test database
#: for sessions whose collected tests ask for it.
STORE_KINDS = [
    "memory",
    "sqlite",
    "postgresql",
    "mysql",
    pytest.param("django", marks=pytest.mark.django_db(transaction=True)),
]


@pytest.fixture(params=STORE_KINDS)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DelayStore]:
    store = make_store(request.param, request, tmp_path)
    yield store
    store.close()


def runs(client: redis.Redis, key: str = "test:runs") -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(key, 0, -1)]


def app_env(broker_url: str, store_url: str, **conf: Any) -> dict[str, str]:
    return {
        "SAFE_TIME_TEST_BROKER_URL": broker_url,
        "SAFE_TIME_TEST_STORE_URL": store_url,
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }


def utcnow() -> datetime:
    return datetime.now(UTC)


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


def drain(url: str, queue: Any) -> list[Any]:  # queue: a kombu Queue or a queue name
    """Every message waiting in ``queue`` (consumed, acknowledged)."""
    out: list[Any] = []
    with Connection(url) as conn:
        simple = conn.SimpleQueue(queue)
        while True:
            try:
                message = simple.get(timeout=1)
            except simple.Empty:
                break
            out.append(message)
            message.ack()
        simple.close()
    return out
