"""Deprecated alias of :mod:`celery_safe_time.delays.backends.sql`."""

from __future__ import annotations

from ..backends.sql.engine import create_engine, database_now, deadline_args, load_driver, normalize_url
from ..backends.sql.schema import UTCDateTime, delays, metadata
from ..backends.sql.store import SQLAlchemyStore

__all__ = [
    "SQLAlchemyStore",
    "UTCDateTime",
    "create_engine",
    "database_now",
    "deadline_args",
    "delays",
    "load_driver",
    "metadata",
    "normalize_url",
]
