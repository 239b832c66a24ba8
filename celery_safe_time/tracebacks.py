"""An uncaught exception in a ``celery beat`` / ``celery worker`` process is written as one log record.

Celery redirects ``sys.stderr`` into its logger (``worker_redirect_stdouts``), one record per
``write()``; Python's default hook prints a traceback in hundreds of small writes, so a beat that
dies at startup ended in over a thousand one-token WARNING lines. The hook here formats the whole
traceback first and writes it once. Outside a redirected stream the previous hook runs unchanged.
"""

from __future__ import annotations

import sys
import traceback
from types import TracebackType
from typing import Any

from celery.signals import after_setup_logger
from celery.utils.log import LoggingProxy

_previous_hook = sys.excepthook


def write_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """``sys.excepthook``: one ``write()`` of the formatted traceback when stderr is Celery's proxy."""
    stream = sys.stderr
    if isinstance(stream, LoggingProxy):
        stream.write("".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n"))
        return
    _previous_hook(exc_type, exc, tb)


def _install_hook(**_: Any) -> None:
    global _previous_hook
    if sys.excepthook is not write_uncaught:
        _previous_hook = sys.excepthook
        sys.excepthook = write_uncaught


# Sent once Celery's logging is set up in beat and worker processes (never in plain imports).
after_setup_logger.connect(_install_hook, weak=False, dispatch_uid="celery_safe_time.tracebacks.install_hook")
