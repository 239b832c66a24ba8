"""What the locks hand over to the durable store: the seam between ``locks/`` and ``delays/``.

A gate's long wait goes to the store, a stored delivery is checked against its row before its first
gate, and a unique key held by a stored task is free once that task's row has ended. The locks call
these through here; :mod:`celery_safe_time.install` (imported with the package) provides the store's
side, loaded on first use, so neither a plain lock nor ``import celery_safe_time`` loads the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, TypeVar

from celery import Celery, Task
from celery.canvas import Signature

R = TypeVar("R")


class CheckedDelivery(Protocol):
    def __call__(self, body: Callable[[], R]) -> R: ...


@dataclasses.dataclass(frozen=True)
class StoreSide:
    #: Publish a signature ``countdown`` seconds from now: the broker for a short wait, the store beyond it.
    send_later: Callable[[Task, Signature, float], None]
    #: Run a body once the store says this delivery may start (a stored row's delivery), else as is.
    checked_delivery: CheckedDelivery
    #: Whether the store's row of a task id says it will never run (again).
    stored_run_ended: Callable[[Celery, str], bool]


_provider: list[Callable[[], StoreSide]] = []
_loaded: list[StoreSide] = []


def provide(loader: Callable[[], StoreSide]) -> None:
    """Set what loads the store's side (called once, by :mod:`celery_safe_time.install`)."""
    _provider[:] = [loader]
    _loaded.clear()


def store_side() -> StoreSide:
    """The store's side, loaded on the first call."""
    if not _loaded:
        if not _provider:
            raise RuntimeError("no store side provided: celery_safe_time.install is not loaded")
        _loaded.append(_provider[0]())
    return _loaded[0]


def send_later(task: Task, sig: Signature, countdown: float) -> None:
    store_side().send_later(task, sig, countdown)


def checked_delivery(body: Callable[[], R]) -> R:
    return store_side().checked_delivery(body)


def stored_run_ended(app: Celery, task_id: str) -> bool:
    return store_side().stored_run_ended(app, task_id)
