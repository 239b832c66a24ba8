"""An idle sweep logs at DEBUG: beat sends the sweep every ``safe_time_sweep_interval`` (5 s), and
at INFO that was one beat line and two worker lines every 5 s with nothing to do.

Celery's own lines (beat's "Sending due task", the worker's "received" and "succeeded") are made
DEBUG by a filter on their loggers: for the sweep task, "received" always (it cannot know yet),
"Discarding revoked task" of an expired one (it expires after one interval, by design) and
"succeeded" when every count it returned is zero. A sweep that did something still logs its
"sweep: N claimed, ..." line and its "succeeded" line at INFO.
"""

from __future__ import annotations

import ast
import logging
from typing import Any

from .. import constants as C

#: Keys of the sweep's returned dict that are not counts of work done.
_NOT_COUNTS = frozenset({"lookahead"})

#: Loggers of Celery's per-message lines: beat's send, the worker's receive and the task's end.
CELERY_MESSAGE_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.worker.request", "celery.app.trace")


class IdleSweepFilter(logging.Filter):
    """Demotes Celery's per-message lines about an idle sweep to DEBUG (dropped below DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not _idle_sweep_line(record):
            return True
        record.levelno = logging.DEBUG
        record.levelname = logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _idle_sweep_line(record: logging.LogRecord) -> bool:
    data: Any = getattr(record, "data", None)
    if isinstance(data, dict) and data.get("name") == C.SWEEP_TASK_NAME:
        # "received" (no return value yet) or "succeeded" with nothing done
        return "return_value" not in data or _all_zero(data["return_value"])
    args = record.args
    if not isinstance(args, tuple) or len(args) < 2:
        return False
    if record.name == "celery.beat":  # "Scheduler: Sending due task %s (%s)" % (entry, task)
        return bool(args[1] == C.SWEEP_TASK_NAME)
    # "Discarding revoked task: %s[%s]": a sweep message past its expiry (one interval), by design
    return bool(args[0] == C.SWEEP_TASK_NAME and str(record.msg).startswith("Discarding revoked task"))


def _all_zero(returned: Any) -> bool:
    """The sweep returns its counts as a dict; Celery logs its repr."""
    try:
        value = ast.literal_eval(returned) if isinstance(returned, str) else returned
    except (ValueError, SyntaxError):
        return False
    return isinstance(value, dict) and not any(v for k, v in value.items() if k not in _NOT_COUNTS)


def install_idle_sweep_filter() -> None:
    """Add the filter to Celery's message loggers, once per process."""
    for name in CELERY_MESSAGE_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, IdleSweepFilter) for f in target.filters):
            target.addFilter(IdleSweepFilter())
