"""The SQL store (SQLAlchemy Core): PostgreSQL, SQLite and MySQL/MariaDB.

Modules: :mod:`.schema` (the table), :mod:`.ddl` (creating and upgrading it), :mod:`.statements`
(conditions and conditional writes), :mod:`.postgres` (the PostgreSQL fast path of the delivery record),
:mod:`.store` (:class:`~.store.SQLStore`, the store's logic, which the Django store runs on Django's
connection, and :class:`SQLAlchemyStore` on an engine of its own); engines, drivers and deadlines are the
package's SQL toolkit (:mod:`celery_safe_time.sql`). Raw SQL lives in ``queries.sql`` and ``schema.sql``
beside them, read by :func:`~celery_safe_time.delays.backends.base.query`.

Importing this package loads neither SQLAlchemy nor a driver: the names below load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ....sql.engine import create_engine, deadline_args, load_driver, normalize_url
    from .schema import UTCDateTime, delays, metadata
    from .store import SQLAlchemyStore

__all__ = [
    "SQLAlchemyStore",
    "UTCDateTime",
    "create_engine",
    "deadline_args",
    "delays",
    "load_driver",
    "metadata",
    "normalize_url",
]

_LAZY = {
    "SQLAlchemyStore": ".store",
    "UTCDateTime": ".schema",
    "delays": ".schema",
    "metadata": ".schema",
    "create_engine": "....sql.engine",
    "deadline_args": "....sql.engine",
    "load_driver": "....sql.engine",
    "normalize_url": "....sql.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
