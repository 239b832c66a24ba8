"""Shared env-driven configuration for the subprocess test apps.

- ``SAFE_TIME_TEST_BROKER_URL``: broker, result backend and (unless overridden) safe_time_redis_url
- ``SAFE_TIME_TEST_STORE_URL``: safe_time_store_url
- ``SAFE_TIME_TEST_APP_CONF``: JSON object of further ``app.conf`` keys
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery


def configure(app: Celery, **defaults: Any) -> Celery:
    broker = os.environ["SAFE_TIME_TEST_BROKER_URL"]
    conf: dict[str, Any] = {
        "broker_url": broker,
        "result_backend": broker,
        "broker_connection_retry_on_startup": True,
        "task_acks_late": False,
        "worker_hijack_root_logger": True,
        "beat_max_loop_interval": 1,
        "timezone": "UTC",
        # The test process's apps and the subprocess apps are one deployment: one store namespace.
        "safe_time_store_namespace": "tests",
    }
    if os.environ.get("SAFE_TIME_TEST_STORE_URL"):
        conf["safe_time_store_url"] = os.environ["SAFE_TIME_TEST_STORE_URL"]
    conf.update(defaults)
    conf.update(json.loads(os.environ.get("SAFE_TIME_TEST_APP_CONF", "{}")))
    app.conf.update(conf)
    return app
