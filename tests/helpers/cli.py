"""``celery -A APP ...`` run inside the test process (click's ``CliRunner``), for the CLI tests that
need no process of their own.

A ``python -m celery`` subprocess costs about a CPU-second per call (Python, Celery and the app
imported afresh), several seconds of wall time on a loaded machine; a test of a dozen commands spent
most of its time starting Pythons. In-process, the command runs the same click code on the same
arguments: the app module is imported afresh under the call's environment (the test apps read their
settings from ``SAFE_TIME_TEST_*`` variables at import), and everything it imported, connected, cached
or set as Celery's current app is put back afterwards, so the next call and the test's own apps see
the process as it was. One difference stays: Django, which pytest-django sets up here, keeps its
database blocked, so a command that reads django-celery-beat's rows says on stderr it cannot.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from celery import Celery
from celery import _state as celery_state
from celery import signals as celery_signals
from celery.utils.dispatch import Signal
from click.testing import CliRunner

#: The test apps (``tests/apps``) read the environment at import: each call imports them afresh.
APPS_PACKAGE = "tests.apps."


def run_celery(app: str, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``celery -A app *args`` in this process, with ``env`` added to the environment and ``cwd`` the
    working directory for the call (a default SQLite store is a file there); returned as
    :func:`subprocess.run` returns the same command's result (exit code, stdout, stderr)."""
    from celery.bin.celery import celery as celery_main

    from celery_safe_time.config import reset_config
    from celery_safe_time.delays.backends import reset_store

    saved = {name: module for name, module in sys.modules.items() if name.startswith(APPS_PACKAGE)}
    _forget(saved)
    current, default = getattr(celery_state._tls, "current_app", None), celery_state.default_app
    # Every @app.task is shared by default: its module's apps hand it to each app finalized after
    # them, so a second import of a test app's module would meet its own tasks, already registered.
    finalizers = set(celery_state._on_app_finalizers)
    celery_state._on_app_finalizers.difference_update({f for f in finalizers if _from_test_apps(f)})
    # ... and the handlers it connects (a test app's before_task_publish) would stay connected here
    receivers = {signal: list(signal.receivers) for signal in _signals()}
    was_in = os.getcwd()
    try:
        os.chdir(cwd)
        logging.getLogger().addHandler(_LAST_RESORT)
        try:
            result = CliRunner(env=env).invoke(celery_main, ["-A", app, *args], prog_name="celery")
        finally:
            logging.getLogger().removeHandler(_LAST_RESORT)
        loaded: ModuleType | None = sys.modules.get(app)
        loaded_app = getattr(loaded, "app", None)
        if isinstance(loaded_app, Celery):
            # What the process's exit would close: the store's connections, the broker pool.
            reset_store(loaded_app)
            reset_config(loaded_app)
            loaded_app.close()
    finally:
        os.chdir(was_in)
        _forget({name: module for name, module in sys.modules.items() if name.startswith(APPS_PACKAGE)})
        sys.modules.update(saved)
        for name, module in saved.items():
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
        celery_state._on_app_finalizers.clear()
        celery_state._on_app_finalizers.update(finalizers)
        for signal, kept in receivers.items():
            signal.receivers[:] = kept
            signal.sender_receivers_cache.clear()
        celery_state._tls.current_app = current
        celery_state.default_app = default
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # a subprocess would print the traceback and exit 1: the test's assertion shows it
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["celery", "-A", app, *args], result.exit_code, result.stdout, stderr)


class _Stderr(logging.Handler):
    """What a command's process prints of its log records, with no logging set up: Python's last
    resort (WARNING and up, the bare message) on the stderr of the moment, the runner's during a call."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


_LAST_RESORT = _Stderr(logging.WARNING)


def _forget(modules: dict[str, ModuleType]) -> None:
    """Unimport ``modules``: out of ``sys.modules`` and off their package, where celery's ``-A``
    (``symbol_by_name``) looks a dotted name up first, as an attribute of ``tests.apps``."""
    for name in modules:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        package = sys.modules.get(parent)
        if package is not None and getattr(package, child, None) is modules[name]:
            delattr(package, child)


def _from_test_apps(finalizer: Callable[..., Any]) -> bool:
    """Whether ``finalizer`` is the one ``@app.task`` (shared) leaves for a task of a test app."""
    for cell in getattr(finalizer, "__closure__", None) or ():
        module = getattr(cell.cell_contents, "__module__", None)
        if isinstance(module, str) and module.startswith(APPS_PACKAGE):
            return True
    return False


def _signals() -> list[Signal]:
    return [value for value in vars(celery_signals).values() if isinstance(value, Signal)]
