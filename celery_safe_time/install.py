"""``install(app)``: validate settings now and register the package's own tasks."""

from __future__ import annotations

import logging

from celery import Celery

from .config import SafeTimeConfig, get_config

logger = logging.getLogger(__name__)


def install(app: Celery) -> SafeTimeConfig:
    """Wire celery-safe-time into ``app``.

    Parses every ``safe_time_*`` setting (raising
    :class:`~celery_safe_time.exceptions.ImproperlyConfigured` naming the bad key), registers
    the sweep task and its beat entry. Safe to call more than once.
    """
    config = get_config(app)
    from .delays import sweep
    from .delays.idle_logs import install_idle_sweep_filter

    sweep.register(app, config)
    install_idle_sweep_filter()
    return config
