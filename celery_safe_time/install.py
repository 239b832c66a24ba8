"""``install(app)``: validate settings now and register the package's own tasks."""

from __future__ import annotations

import difflib
import logging
import zoneinfo

from celery import Celery

from . import tracebacks  # noqa: F401 - installs the one-record traceback hook in beat/worker processes
from .config import SafeTimeConfig, get_config
from .exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)


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
    return config


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
