"""Is the sweep installed? Without ``celery_safe_time.install(app)`` long delays are stored and never
sent: storing a row, starting a safe scheduler and ``safe-time check`` each say so.

Why say it instead of installing the sweep behind the user's back: beat could add its own entry, but
the *worker* runs the sweep task, and a worker whose app never called ``install()`` drops it as an
unregistered task. Only ``install(app)`` in the module every process imports fixes both sides.
"""

from __future__ import annotations

import logging
import weakref

from celery import Celery

from . import constants as C

logger = logging.getLogger(__name__)

_warned: weakref.WeakSet[Celery] = weakref.WeakSet()
#: Apps whose stored rows are run some other way (:func:`sweep_not_needed`).
_run_otherwise: weakref.WeakSet[Celery] = weakref.WeakSet()


def sweep_installed(app: Celery) -> bool:
    """True when ``install(app)`` registered the sweep task and its beat entry on ``app``."""
    return C.SWEEP_TASK_NAME in app.tasks and C.SWEEP_ENTRY_NAME in (app.conf.beat_schedule or {})


def not_installed_message(app: Celery) -> str:
    return (
        f"celery_safe_time.install(app) was not called on app {app.main!r}: no {C.SWEEP_TASK_NAME} task or "
        "beat entry, so stored delays are never sent; call it in the module that creates the app"
    )


def sweep_not_needed(app: Celery) -> None:
    """Never warn for ``app``: its stored delays are run some other way (the testing plugin's ``run_due``)."""
    _warned.add(app)
    _run_otherwise.add(app)


def rows_are_sent(app: Celery) -> bool:
    """Whether something sends ``app``'s stored rows: the sweep (``install(app)``), or :func:`sweep_not_needed`."""
    return app in _run_otherwise or sweep_installed(app)


def warn_once_if_not_installed(app: Celery) -> None:
    """An ERROR, once per app and process, when a row is stored for an app without the sweep."""
    if app in _warned or sweep_installed(app):
        return
    _warned.add(app)
    logger.error("stored a delay: %s", not_installed_message(app))
