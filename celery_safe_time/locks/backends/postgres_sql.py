"""The PostgreSQL lock backend's SQL and its install: ``locks/sql/schema.sql`` (the tables, the fence
sequence and the PL/pgSQL functions) and ``locks/sql/queries.sql`` (every statement the backend runs),
named statements read once at import.

:func:`ensure_schema` runs the schema on a database that lacks it, once per process and engine. The
backend (:mod:`.postgres`) turns a database that cannot be reached into ``CoordinationUnavailable``.
"""

from __future__ import annotations

import threading

import sqlalchemy as sa

from ... import constants as C
from ...sql.named import named_statements

__all__ = ["QUERIES", "SCHEMA", "SCHEMA_LOCK_KEY", "ensure_schema"]

#: Serialises schema creation between processes (a transaction advisory lock).
SCHEMA_LOCK_KEY = C.LOCK_SCHEMA_LOCK_KEY


#: The tables, the sequence and the functions (``locks/sql/schema.sql``), run in order.
SCHEMA = tuple(named_statements("celery_safe_time.locks", "sql/schema.sql").values())

#: Every statement the backend runs (``locks/sql/queries.sql``), by name, as text: the per-task calls
#: take ``$n`` parameters for libpq, the others ``:name`` ones for ``sqlalchemy.text``.
QUERIES = named_statements("celery_safe_time.locks", "sql/queries.sql")

_ready: set[tuple[int, str]] = set()
_ready_lock = threading.Lock()


def ensure_schema(engine: sa.Engine) -> bool:
    """Create the tables, sequence and functions unless the database of ``engine`` has them; True when
    this call created them. Asks the database once per process and engine; raises what the driver raises.
    """
    key = (id(engine), str(engine.url))
    if key in _ready:
        return False
    created = False
    with _ready_lock:
        if key in _ready:
            return False
        with engine.connect() as conn:
            present = sa.text(QUERIES["schema_present"])
            if not conn.execute(present).scalar_one():
                conn.execute(sa.text("BEGIN"))
                conn.execute(sa.text(QUERIES["schema_lock"]), {"key": SCHEMA_LOCK_KEY})
                # Asked again under the lock: a process that took it first may have made the schema,
                # and its DDL run again beside that process's lock calls deadlocks with them (a
                # CREATE INDEX IF NOT EXISTS waits for its table's SHARE lock even when the index exists).
                if not conn.execute(present).scalar_one():
                    # The driver's own execute: no parameters, so no placeholder parsing of ``%ROWTYPE``.
                    driver = conn.connection.driver_connection
                    assert driver is not None
                    for statement in SCHEMA:
                        driver.execute(statement)
                    created = True
                conn.execute(sa.text("COMMIT"))
        _ready.add(key)
    return created
