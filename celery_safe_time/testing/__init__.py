"""Test helpers for code that uses celery-safe-time: a pytest plugin, usable without pytest too.

``task_always_eager`` runs everything at once and ignores countdowns, so it bypasses the store: a
test of "remind in 14 days" proves nothing. Here the delays go through the real ``SafeTask`` path
into an in-memory store whose clock the test moves forward:

```python
def test_trial_reminder(safe_time):
    start_trial.delay(user_id=42)
    safe_time.assert_stored(send_reminder, kwargs={"user_id": 42}, due_within=timedelta(days=14, minutes=1))
    ran = safe_time.run_due(advance=timedelta(days=14))
    assert [r.task for r in ran] == [send_reminder.name]
```

What :func:`safe_time_testing` replaces for the block (the store, the lock backend, Redis, the
broker and the result backend: nothing of the app's production settings is reached), what each
helper asserts and what is not covered: docs/testing.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from celery import Celery

from ..locks.backends.memory import MemoryLockBackend
from .kit import NO_REDIS_URL as NO_REDIS_URL
from .kit import LimitedCall, RunResult, SafeTimeTesting, StoredDelay, safe_time_testing
from .kit import TestStoreKind as TestStoreKind
from .schedules import next_fires
from .shortcuts import (
    assert_idempotent_done,
    assert_lock_free,
    assert_lock_held,
    assert_not_rate_limited,
    assert_rate_limited,
    assert_stored,
    assert_unique_free,
    assert_unique_held,
    deliver,
    run_due,
    stored_delays,
)
from .stores import TestSQLiteStore, TestStore

__all__ = [
    "LimitedCall",
    "MemoryLockBackend",
    "RunResult",
    "SafeTimeTesting",
    "StoredDelay",
    "TestSQLiteStore",
    "TestStore",
    "assert_idempotent_done",
    "assert_lock_free",
    "assert_lock_held",
    "assert_not_rate_limited",
    "assert_rate_limited",
    "assert_stored",
    "assert_unique_free",
    "assert_unique_held",
    "deliver",
    "next_fires",
    "run_due",
    "safe_time_testing",
    "stored_delays",
]


# --- the pytest plugin (entry point ``pytest11``: celery_safe_time = celery_safe_time.testing) -----

try:
    import pytest
except ImportError:  # pragma: no cover - usable without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def safe_time_app() -> Iterator[Celery]:
        """The app under test. Override it in your conftest.py to return your own app
        (or Celery's ``celery_app`` fixture); the default is a fresh app, current for the test."""
        app = Celery("safe_time_test", broker="memory://", task_cls="celery_safe_time:SafeTask", set_as_current=False)
        try:
            with _current(app):
                yield app
        finally:
            app.close()

    @pytest.fixture
    def safe_time_options() -> dict[str, Any]:
        """Keyword arguments of :func:`safe_time_testing` (override: ``{"broker_url": "memory://"}``)."""
        return {}

    @pytest.fixture
    def safe_time(safe_time_app: Celery, safe_time_options: dict[str, Any]) -> Iterator[SafeTimeTesting]:
        """``safe_time_app`` with the in-memory store, lock store and test clock (:class:`SafeTimeTesting`)."""
        with safe_time_testing(safe_time_app, **safe_time_options) as handle:
            yield handle

    @pytest.fixture
    def safe_time_sqlite(safe_time_app: Celery, safe_time_options: dict[str, Any]) -> Iterator[SafeTimeTesting]:
        """As ``safe_time``, with the stored delays in a temporary SQLite file (the SQL store)."""
        with safe_time_testing(safe_time_app, **{**safe_time_options, "store": "sqlite"}) as handle:
            yield handle


@contextlib.contextmanager
def _current(app: Celery) -> Iterator[None]:
    """Make ``app`` the current (and default) app for the block, so ``@shared_task`` binds to it."""
    from celery import _state

    previous = _state.get_current_app()
    app.set_current()
    try:
        yield
    finally:
        _state._set_current_app(previous)
