"""The PostgreSQL fast path of the SQL store: the delivery record's per-task writes on raw connections."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine.interfaces import DBAPIModule

from ....sql.engine import create_engine

logger = logging.getLogger(__name__)


class RecordWrites:
    """PostgreSQL: the delivery record's per-task writes (start, heartbeat, end), each a statement
    compiled once and sent as it is on a pooled psycopg connection in autocommit.

    What SQLAlchemy does around one statement (construct, cache key, execution context, pre-ping) costs
    more than the statement; the same SQL text each time also lets psycopg prepare it. ``engines[True]``
    waits for the WAL flush, ``engines[False]`` has ``synchronous_commit=off``. No pre-ping: a statement
    on a connection the server closed empties the pool and is sent once more, which every statement here
    allows (a start names its own run id, a heartbeat sets a time, an end that landed changes nothing).
    """

    def __init__(self, url: str, timeout: float | None = None) -> None:
        options: dict[str, Any] = {
            "timeout": timeout,
            "isolation_level": "AUTOCOMMIT",
            "pool_pre_ping": False,
            # Autocommit: a connection goes back with no transaction open, so no ROLLBACK on check-in.
            "pool_reset_on_return": None,
            "pool_size": 2,
        }
        self.engines = {
            True: create_engine(url, **options),
            False: create_engine(
                url,
                connect_args={"options": "-c synchronous_commit=off"},
                **options,
            ),
        }
        self.dbapi_error: type[DBAPIModule.Error] = self.engines[True].dialect.loaded_dbapi.Error
        #: key -> (SQL text, values of the binds the statement fixes); a key names one statement shape.
        self._compiled: dict[Hashable, tuple[str, dict[str, Any]]] = {}

    def dispose(self) -> None:
        for engine in self.engines.values():
            engine.dispose()

    def rowcount(self, key: Hashable, build: Callable[[], sa.Update], params: dict[str, Any], *, durable: bool) -> int:
        """Rows changed by the statement ``key`` (made by ``build`` the first time) with ``params``."""
        engine = self.engines[durable]
        compiled = self._compiled.get(key)
        if compiled is None:
            # render_postcompile: the inlined literals (status_is) become part of the text.
            statement = build().compile(dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
            compiled = self._compiled[key] = (statement.string, dict(statement.params))
        sql, fixed = compiled
        values = {**fixed, **params}
        for fresh in (False, True):
            raw = engine.raw_connection()
            try:
                cursor = raw.cursor()
                try:
                    cursor.execute(sql, values)
                    return int(cursor.rowcount)
                finally:
                    cursor.close()
            except self.dbapi_error as exc:
                if fresh or not engine.dialect.is_disconnect(exc, raw.dbapi_connection, None):
                    raise
                raw.invalidate(exc)
                # The rest of the pool was most likely cut with it: start over on new connections.
                engine.dispose()
                logger.info("store connection lost (%s), sending the statement again on a new one", exc)
            finally:
                raw.close()
        raise AssertionError("unreachable")  # pragma: no cover - the second attempt returns or raises
