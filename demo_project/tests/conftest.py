"""The demo's tests run against its real Celery app, with celery_safe_time.testing's in-process store and locks."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery


@pytest.fixture
def safe_time_app() -> Celery:
    from demo_project.celery_app import app

    return app


@pytest.fixture
def safe_time_options() -> dict[str, Any]:
    # Immediate calls (run_invoices fans out send_invoice) stay in this process instead of Redis.
    return {"broker_url": "memory://"}
