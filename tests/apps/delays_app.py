"""App for the durable-delay tests: SafeTask tasks, a plain task, the sweep installed.

Fault hooks (environment variables, only for tests):
- ``DELAYS_TEST_HANG_BEFORE_PUBLISH=1``: the first publish of a stored task blocks forever
  (the sweeper has claimed rows but published nothing): kill -9 it there.
- ``DELAYS_TEST_HANG_AFTER_PUBLISH=1``: the first batch of stored tasks is published, then the
  sweeper blocks (published but not yet marked sent).
Both write ``test:hung`` in Redis when they block.
- ``DELAYS_TEST_LOSE_START_REPLY=1``: the first conditional start of each stored delivery is
  written to the store, then its reply is "lost" (a ``StoreError`` as a cut connection raises).
- ``DELAYS_TEST_CLOCK_AHEAD=<seconds>``: the worker's wall clock is that far ahead where it decides
  when a message's ``eta`` is reached (kombu's timer); what the tasks record stays true time.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import before_task_publish

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays.backends.base import DelayStore
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.exceptions import StoreError
from tests.apps.delays_tasks import define_tasks
from tests.apps.settings import configure

app = configure(Celery("delays_app"))
install(app)
tasks = define_tasks(app)
_redis = redis.Redis.from_url(os.environ.get("SAFE_TIME_TEST_RECORD_URL") or os.environ["SAFE_TIME_TEST_BROKER_URL"])


def _hang(marker: str) -> None:
    _redis.set("test:hung", marker)
    while True:
        time.sleep(1)


@before_task_publish.connect
def _hang_before(sender: str | None = None, headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    if os.environ.get("DELAYS_TEST_HANG_BEFORE_PUBLISH") and headers and headers.get(C.HEADER_STORED):
        _hang("before")


if os.environ.get("DELAYS_TEST_HANG_AFTER_PUBLISH"):

    def _hang_before_marking(self: DelayStore, task_ids: Any, token: str) -> int:
        # The batch is out (on Redis its pipeline ran, on RabbitMQ its confirms came back): not marked yet.
        _hang("after")
        return 0

    DelayStore.mark_sent = _hang_before_marking  # type: ignore[method-assign]


if os.environ.get("DELAYS_TEST_LOSE_START_REPLY"):
    _start = SQLAlchemyStore.start
    _lost: set[str] = set()

    def _start_losing_the_first_reply(self: SQLAlchemyStore, task_id: str, *args: Any, **kwargs: Any) -> Any:
        result = _start(self, task_id, *args, **kwargs)  # committed in the real database
        if task_id not in _lost:
            _lost.add(task_id)
            raise StoreError(f"connection lost before the reply to the start of {task_id} (test fault)")
        return result

    SQLAlchemyStore.start = _start_losing_the_first_reply  # type: ignore[method-assign]


if os.environ.get("DELAYS_TEST_CLOCK_AHEAD"):
    import kombu.asynchronous.timer as _timer

    _ahead = float(os.environ["DELAYS_TEST_CLOCK_AHEAD"])
    _timer._time = lambda: time.time() + _ahead  # type: ignore[attr-defined]
