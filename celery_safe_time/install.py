"""``install(app)``: validate settings now and register the package's own tasks.

Importing it (the package does) also installs the one-record traceback hook in ``celery beat`` /
``celery worker`` processes (:func:`write_uncaught`), and gives the locks the store's side of their
hand-offs (:mod:`.handoff`), loaded on first use.
"""

from __future__ import annotations

import difflib
import logging
import sys
import traceback
import zoneinfo
from types import TracebackType
from typing import Any

from celery import Celery
from celery.signals import after_setup_logger, task_postrun, task_prerun, task_revoked, worker_init
from celery.utils.log import LoggingProxy

from . import constants as C
from . import handoff
from .config import SafeTimeConfig, get_config
from .exceptions import ImproperlyConfigured, SafeTimeError

logger = logging.getLogger(__name__)


def _store_side() -> handoff.StoreSide:
    from .delays.backends import stored_run_ended
    from .delays.waits import checked_delivery, send_later

    return handoff.StoreSide(send_later, checked_delivery, stored_run_ended)


handoff.provide(_store_side)


def install(app: Celery) -> SafeTimeConfig:
    """Wire celery-safe-time into ``app``.

    Parses every ``safe_time_*`` setting (raising
    :class:`~celery_safe_time.exceptions.ImproperlyConfigured` naming the bad key), registers
    the sweep task and its beat entry. Safe to call more than once.
    """
    config = get_config(app)
    check_timezone(app)
    from .delays import sweep
    from .delays.idle_logs import install_idle_sweep_filter

    sweep.register(app, config)
    install_idle_sweep_filter()
    # Connected here, after the app (and Celery's Django fixup, which sets Django up on the same
    # signal) exists: the check of a Django store needs the ORM ready.
    worker_init.connect(check_worker_startup, weak=False, dispatch_uid="celery_safe_time.install.worker_checks")
    return config


def check_worker_startup(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker says what is wrong with its store or coordination backend before it
    says "ready", one line per problem naming the setting. A setting or a missing driver cannot heal:
    CRITICAL, and the worker stops (``SystemExit``: Celery swallows any other exception a signal handler
    raises). A backend that does not answer now may in a moment: ERROR, and the worker starts, as
    Celery's does while its broker is away.
    """
    app = getattr(sender, "app", None)
    if not isinstance(app, Celery):
        return
    from .checks import worker_startup_problems
    from .delays.backends import close_before_fork

    problems = worker_startup_problems(app)
    # The pool forks next: its children open their own connections, none shared with this process.
    close_before_fork(app)
    for problem in problems:
        if problem.fatal:
            logger.critical("worker: %s", problem.detail)
        else:
            logger.error("worker: %s (starting anyway: calls that need it wait for it)", problem.detail)
    if any(problem.fatal for problem in problems):
        raise SystemExit(1)


def check_timezone(app: Celery) -> None:
    """Raise :class:`ImproperlyConfigured` naming ``timezone`` when the app's time zone is unknown.

    Celery reads it lazily, so a typo otherwise passes until beat computes its first due time
    and dies; Django's ``TIME_ZONE`` is what ``app.conf.timezone`` falls back to.
    """
    name = app.conf.timezone
    if name is None or isinstance(name, zoneinfo.ZoneInfo) or hasattr(name, "utcoffset"):
        return
    if isinstance(name, str) and name:
        try:
            zoneinfo.ZoneInfo(name)
            return
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            pass
    close = difflib.get_close_matches(str(name), sorted(zoneinfo.available_timezones()), n=1)
    hint = f"did you mean {close[0]!r}?" if close else "use an IANA name such as 'UTC' or 'Europe/London'"
    raise ImproperlyConfigured("timezone", f"{name!r} is not a known time zone: {hint}")


# An uncaught exception in a ``celery beat`` / ``celery worker`` process is written as one log record.
# Celery redirects ``sys.stderr`` into its logger (``worker_redirect_stdouts``), one record per
# ``write()``; Python's default hook prints a traceback in hundreds of small writes, so a beat that
# dies at startup would end in over a thousand one-token WARNING lines. The hook formats the whole
# traceback first and writes it once. Outside a redirected stream the previous hook runs unchanged.

_previous_hook = sys.excepthook


def write_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """``sys.excepthook``: one ``write()`` of the formatted traceback when stderr is Celery's proxy.

    One of this package's own errors (an unreachable Redis at beat's start) already says what and
    where: one line, not the frames of the command line and of the driver under it."""
    stream = sys.stderr
    if isinstance(stream, LoggingProxy):
        if isinstance(exc, SafeTimeError):
            stream.write(f"{exc_type.__name__}: {exc}")
            return
        stream.write("".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n"))
        return
    _previous_hook(exc_type, exc, tb)


class OwnErrorsInOneLine(logging.Filter):
    """On Celery's "beat raised exception" CRITICAL: no traceback when the exception is one of this
    package's own, whose message names the setting, the (masked) URL and the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], SafeTimeError):
            record.exc_info = None
            record.exc_text = None
        return True


_ONE_LINE = OwnErrorsInOneLine()


def _install_hook(**_: Any) -> None:
    global _previous_hook
    if sys.excepthook is not write_uncaught:
        _previous_hook = sys.excepthook
        sys.excepthook = write_uncaught
    beat_logger = logging.getLogger("celery.beat")  # celery/apps/beat.py logs its CRITICAL there
    if _ONE_LINE not in beat_logger.filters:
        beat_logger.addFilter(_ONE_LINE)


# Sent once Celery's logging is set up in beat and worker processes (never in plain imports).
after_setup_logger.connect(_install_hook, weak=False, dispatch_uid="celery_safe_time.install.traceback_hook")


def _install_entry_runs(sender: Any = None, **_: Any) -> None:
    """``worker_init`` (main process, before the tracers are built and the pool forks): route every
    task's runs through the beat overlap gate (a message without its header goes straight through)."""
    app = getattr(sender, "app", None)
    if isinstance(app, Celery):
        from .locks.entry_runs import install_worker

        install_worker(app)


def _entry_run_revoked(**kwargs: Any) -> None:
    from .locks.entry_runs import on_revoked

    on_revoked(**kwargs)


worker_init.connect(_install_entry_runs, weak=False, dispatch_uid="celery_safe_time.install.entry_runs")
task_revoked.connect(_entry_run_revoked, weak=False, dispatch_uid="celery_safe_time.install.entry_run_revoked")


# The run history of beat entries (``beat/history.py``): the worker reports each beat-published task's
# outcome. Connected here, with the package, so every worker reports; the history module (and beat
# with it) loads only when a task published by beat runs.
def _from_beat(request: Any) -> bool:
    """Whether ``request`` carries the entry header (in its headers, or set on it as Celery sets a
    protocol 2 message's custom headers): a check of its own, so that every other task pays two
    dict lookups and no import."""
    if request is None:
        return False
    headers = getattr(request, "headers", None)
    if headers and C.HEADER_ENTRY in headers:
        return True
    own = getattr(request, "__dict__", None)
    return bool(own and own.get(C.HEADER_ENTRY))


def _run_started(task: Any = None, **kwargs: Any) -> None:
    if _from_beat(getattr(task, "request", None)):
        from .beat import history

        history.on_prerun(task=task, **kwargs)


def _run_finished(task: Any = None, **kwargs: Any) -> None:
    if _from_beat(getattr(task, "request", None)):
        from .beat import history

        history.on_postrun(task=task, **kwargs)


def _run_revoked(request: Any = None, **kwargs: Any) -> None:
    if _from_beat(request):
        from .beat import history

        history.on_revoked(request=request, **kwargs)


task_prerun.connect(_run_started, weak=False, dispatch_uid="celery_safe_time.beat.history.started")
task_postrun.connect(_run_finished, weak=False, dispatch_uid="celery_safe_time.beat.history.finished")
task_revoked.connect(_run_revoked, weak=False, dispatch_uid="celery_safe_time.beat.history.revoked")
