"""App for the durable-delay tests: SafeTask tasks, a plain task, the sweep installed.

Fault hooks (environment variables, only for tests):
- ``DELAYS_TEST_HANG_BEFORE_PUBLISH=1``: the first publish of a stored task blocks forever
  (the sweeper has claimed rows but published nothing): kill -9 it there.
- ``DELAYS_TEST_HANG_AFTER_PUBLISH=1``: the first stored task is published, then it blocks
  (published but not yet marked sent).
Both write ``test:hung`` in Redis when they block.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish

from celery_safe_time import constants as C
from celery_safe_time import install
from tests.apps.delays_tasks import define_tasks
from tests.apps.settings import configure

app = configure(Celery("delays_app"))
install(app)
tasks = define_tasks(app)
_redis = redis.Redis.from_url(os.environ["SAFE_TIME_TEST_BROKER_URL"])


def _hang(marker: str) -> None:
    _redis.set("test:hung", marker)
    while True:
        time.sleep(1)


@before_task_publish.connect
def _hang_before(sender: str | None = None, headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    if os.environ.get("DELAYS_TEST_HANG_BEFORE_PUBLISH") and headers and headers.get(C.HEADER_STORED):
        _hang("before")


@after_task_publish.connect
def _hang_after(sender: str | None = None, headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    if os.environ.get("DELAYS_TEST_HANG_AFTER_PUBLISH") and headers and headers.get(C.HEADER_STORED):
        _hang("after")
