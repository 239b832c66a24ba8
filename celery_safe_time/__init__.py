"""celery-safe-time: "run later" that means the same thing on every machine of a Celery deployment.

Single-leader Beat with per-slot dedupe, durable long delays, per-key overlap locks,
idempotency keys and DST-correct crontabs. See README.md.

Public names are imported lazily so that ``import celery_safe_time`` (done by Celery's
entry-point scan and by ``task_cls='celery_safe_time:SafeTask'``) stays cheap and never
imports Django or SQLAlchemy unless the feature is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import exceptions, signals
from .config import SafeTimeConfig, get_config
from .install import install

if TYPE_CHECKING:
    # What editors and mypy see for the lazy names below: one import per _LAZY entry, the same
    # module (tests/unit/test_typing.py checks they stay in step).
    from .beat.entries import EntryInfo, delete_entry, get_entry, list_entries, save_entries, save_entry
    from .beat.history import AuditRecord, RunRecord, entry_audit, entry_history
    from .beat.scheduler import SafeScheduler
    from .delays.admin import cancel, rerun, reschedule
    from .delays.task import SafeTask
    from .locks.idempotency import idempotent
    from .locks.limits import concurrency_limit, rate_limit
    from .locks.overlap import overlap_lock
    from .schedules import crontab, next_local

# 0.x until the public API is frozen; CHANGES.md says what each version changes for users.
__version__ = "0.9.0"

_LAZY: dict[str, str] = {
    # beat
    "SafeScheduler": ".beat.scheduler",
    "EntryInfo": ".beat.entries",
    "delete_entry": ".beat.entries",
    "get_entry": ".beat.entries",
    "list_entries": ".beat.entries",
    "save_entry": ".beat.entries",
    "save_entries": ".beat.entries",
    "entry_history": ".beat.history",
    "entry_audit": ".beat.history",
    "RunRecord": ".beat.history",
    "AuditRecord": ".beat.history",
    "crontab": ".schedules",
    "next_local": ".schedules",
    # delays
    "SafeTask": ".delays.task",
    "cancel": ".delays.admin",
    "reschedule": ".delays.admin",
    "rerun": ".delays.admin",
    # locks
    "overlap_lock": ".locks.overlap",
    "idempotent": ".locks.idempotency",
    "rate_limit": ".locks.limits",
    "concurrency_limit": ".locks.limits",
}

__all__ = [  # noqa: RUF022 - grouped by capability, not sorted
    # beat
    "SafeScheduler",
    "EntryInfo",
    "delete_entry",
    "get_entry",
    "list_entries",
    "save_entry",
    "save_entries",
    "entry_history",
    "entry_audit",
    "RunRecord",
    "AuditRecord",
    "crontab",
    "next_local",
    # delays
    "SafeTask",
    "cancel",
    "reschedule",
    "rerun",
    # locks
    "idempotent",
    "overlap_lock",
    "rate_limit",
    "concurrency_limit",
    # setup and the shared core
    "SafeTimeConfig",
    "exceptions",
    "get_config",
    "install",
    "signals",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_safe_time' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
