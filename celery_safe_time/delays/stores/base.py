"""Deprecated alias of :mod:`celery_safe_time.delays.backends.base`."""

from __future__ import annotations

from ..backends.base import *  # noqa: F403
