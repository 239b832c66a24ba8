"""The module-level helpers: each asks the handle of the app under test (the only one, or ``app=``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery import Celery, Task

from ..locks.backends import LockInfo
from .kit import LimitedCall, RunResult, SafeTimeTesting, StoredDelay, _active


def _handle(app: Celery | None, task: Task | str | None = None) -> SafeTimeTesting:
    if app is None and isinstance(task, Task):
        app = task._get_app()
    if app is not None:
        handle = _active.get(app)
        if handle is None:
            raise RuntimeError(f"{app!r} is not under safe_time_testing() (use the safe_time fixture)")
        return handle
    if len(_active) == 1:
        return next(iter(_active.values()))
    raise RuntimeError(
        f"{len(_active)} apps are under safe_time_testing(): pass app=" if _active else "no app is under test"
    )


def stored_delays(task: Task | str | None = None, app: Celery | None = None) -> list[StoredDelay]:
    """The pending stored calls (of ``task``) of the app under test, by due time."""
    return _handle(app, task).stored_delays(task)


def assert_stored(
    task: Task | str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    due_within: timedelta | None = None,
    due_after: timedelta | None = None,
    count: int | None = None,
    app: Celery | None = None,
) -> StoredDelay:
    """See :meth:`SafeTimeTesting.assert_stored`."""
    return _handle(app, task).assert_stored(task, args, kwargs, due_within=due_within, due_after=due_after, count=count)


def run_due(
    advance: timedelta | float = timedelta(0),
    app: Celery | None = None,
    *,
    worker: Any = None,
    propagate: bool = True,
) -> list[RunResult]:
    """See :meth:`SafeTimeTesting.run_due`."""
    return _handle(app).run_due(advance, worker=worker, propagate=propagate)


def deliver(
    task: Task | str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    app: Celery | None = None,
    propagate: bool = True,
) -> RunResult:
    """See :meth:`SafeTimeTesting.deliver`."""
    return _handle(app, task).deliver(task, args, kwargs, propagate=propagate)


def assert_rate_limited(
    task: Task | str | None = None,
    *,
    key: str | None = None,
    count: int | None = None,
    wait_at_least: timedelta | float | None = None,
    app: Celery | None = None,
) -> list[LimitedCall]:
    """See :meth:`SafeTimeTesting.assert_rate_limited`."""
    return _handle(app, task).assert_rate_limited(task, key=key, count=count, wait_at_least=wait_at_least)


def assert_not_rate_limited(
    task: Task | str | None = None, *, key: str | None = None, app: Celery | None = None
) -> None:
    """See :meth:`SafeTimeTesting.assert_not_rate_limited`."""
    _handle(app, task).assert_not_rate_limited(task, key=key)


def assert_lock_held(key: str, app: Celery | None = None) -> LockInfo:
    return _handle(app).assert_lock_held(key)


def assert_lock_free(key: str, app: Celery | None = None) -> None:
    _handle(app).assert_lock_free(key)


def assert_idempotent_done(key: str, app: Celery | None = None) -> None:
    _handle(app).assert_idempotent_done(key)


def assert_unique_held(
    key: str, app: Celery | None = None, *, task_id: str | None = None, state: str | None = None
) -> LockInfo:
    """See :meth:`SafeTimeTesting.assert_unique_held`."""
    return _handle(app).assert_unique_held(key, task_id=task_id, state=state)


def assert_unique_free(key: str, app: Celery | None = None) -> None:
    """See :meth:`SafeTimeTesting.assert_unique_free`."""
    _handle(app).assert_unique_free(key)
