"""A sweep that published rows but could not mark them sent says so, naming the rows."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

import pytest
from celery import Celery

from celery_safe_time import install
from celery_safe_time.exceptions import StoreError
from celery_safe_time.stores.memory import MemoryStore
from celery_safe_time.sweep import sweep
from tests.helpers.delays import new_delay, utcnow


class CutAfterPublish(MemoryStore):
    def mark_sent(self, task_ids: Sequence[str], token: str) -> int:
        raise StoreError("store postgresql://db/app: OperationalError: server closed the connection")


def test_mark_sent_failure_is_logged_with_the_published_rows(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("ctx", set_as_current=False)
    app.conf.update(
        broker_url="memory://", safe_time_redis_url="redis://127.0.0.1:1/0", safe_time_store_url="memory://"
    )
    install(app)

    @app.task(name="tests.delays.record", shared=False)
    def record(label: str) -> None: ...

    store = CutAfterPublish()
    store.insert(new_delay("row-1", utcnow() - timedelta(seconds=1)))
    with caplog.at_level(logging.ERROR, logger="celery_safe_time.sweep"), pytest.raises(StoreError):
        sweep(app, store=store)
    message = caplog.records[-1].getMessage()
    assert "published 1 stored delays but could not mark them sent" in message
    assert "row-1" in message
    assert "OperationalError" in message
    assert store.get("row-1").status == "claimed"  # type: ignore[union-attr]
    app.close()
