"""celery-safe-time: "run later" that means the same thing on every machine of a Celery deployment.

Single-leader Beat with per-slot dedupe, durable long delays, per-key overlap locks,
idempotency keys and DST-correct crontabs. See README.md.

Public names are imported lazily so that ``import celery_safe_time`` (done by Celery's
entry-point scan and by ``task_cls='celery_safe_time:SafeTask'``) stays cheap and never
imports Django or SQLAlchemy unless the feature is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import exceptions, signals
from .config import SafeTimeConfig, get_config
from .install import install

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "SafeScheduler": ".scheduler",
    "SafeTask": ".task",
    "overlap_lock": ".locks",
    "idempotent": ".idempotency",
    "crontab": ".schedules",
    "next_local": ".schedules",
    "cancel": ".delays",
    "reschedule": ".delays",
}

__all__ = [
    "SafeScheduler",
    "SafeTask",
    "SafeTimeConfig",
    "cancel",
    "crontab",
    "exceptions",
    "get_config",
    "idempotent",
    "install",
    "next_local",
    "overlap_lock",
    "reschedule",
    "signals",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_safe_time' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
