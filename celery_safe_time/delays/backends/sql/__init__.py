"""The SQL store (SQLAlchemy Core): PostgreSQL, SQLite and MySQL/MariaDB.

Modules: :mod:`.engine` (drivers, deadlines, the database's clock), :mod:`.schema` (the table),
:mod:`.statements` (conditions and conditional writes), :mod:`.postgres` (the PostgreSQL fast path of
the delivery record), :mod:`.store` (:class:`SQLAlchemyStore`). Raw SQL lives in ``queries.sql`` and
``schema.sql`` beside them, read by :func:`query` (:mod:`.named`).

Importing this package loads neither SQLAlchemy nor a driver: the names below load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .named import query

if TYPE_CHECKING:
    from .engine import create_engine, database_now, deadline_args, load_driver, normalize_url
    from .schema import UTCDateTime, delays, metadata
    from .store import SQLAlchemyStore

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
    "query",
]

_LAZY = {
    "SQLAlchemyStore": "store",
    "UTCDateTime": "schema",
    "delays": "schema",
    "metadata": "schema",
    "create_engine": "engine",
    "database_now": "engine",
    "deadline_args": "engine",
    "load_driver": "engine",
    "normalize_url": "engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
