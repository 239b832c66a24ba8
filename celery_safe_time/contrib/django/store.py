"""The Django store (``safe_time_store_url = "django"``): the SQL store's statements on Django's connection.

Every call runs in ``transaction.atomic(using=...)`` on the connection Django holds for the alias in
this thread: inside a caller's own transaction a stored row commits (or rolls back) with it. Django
creates the table (the contrib app's migrations).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from django.db import DataError, IntegrityError, InterfaceError, connections, transaction
from django.db import Error as DjangoDbError
from sqlalchemy.engine import Connection, Engine

from ... import constants as C
from ...delays.backends.sql.store import SQLStore
from ...exceptions import StoreError

#: Django's DB-API module -> the SQLAlchemy dialect that speaks to its connections.
_DIALECTS = {
    "psycopg": "postgresql+psycopg://",
    "psycopg2": "postgresql+psycopg2://",
    "sqlite3": "sqlite+pysqlite://",
    "MySQLdb": "mysql+mysqldb://",
    "pymysql": "mysql+pymysql://",  # installed as MySQLdb
}


class _Lent:
    """Django's DB-API connection as SQLAlchemy sees it: Django's ``atomic()`` commits or rolls back
    the transaction, and Django closes the connection, so those calls from SQLAlchemy do nothing."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass


@functools.cache
def _engine(using: str, url: str) -> Engine:
    """One engine per alias (its compiled-statement cache lives across calls) whose every checkout is
    the connection Django holds for ``using`` in the calling thread."""
    options: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Django's SQLite connection parses datetime columns itself (detect_types) and binds datetimes
        # with its own adapter: SQLAlchemy passes them through.
        options["native_datetime"] = True
    return sa.create_engine(
        url,
        creator=lambda: _Lent(connections[using].connection),
        poolclass=sa.pool.NullPool,
        pool_reset_on_return=None,
        # No connect-time queries and no rollback from SQLAlchemy on Django's connection, which may be
        # inside the caller's transaction: the dialect's defaults fit the statements of the store.
        _initialize=False,
        **options,
    )


class DjangoStore(SQLStore):
    """Rows in the ``celery_safe_time`` app's table, on Django's database alias ``using``."""

    def __init__(self, using: str = "default") -> None:
        self.using = using
        self.url = C.DJANGO_STORE

    @functools.cached_property
    def engine(self) -> Engine:  # type: ignore[override]
        """The engine for Django's driver, found at first use (Django is set up by then)."""
        module = connections[self.using].Database.__name__.partition(".")[0]
        if module not in _DIALECTS:
            raise StoreError(f"django store ({self.using}): no SQL dialect for Django's database driver {module!r}")
        return _engine(self.using, _DIALECTS[module])

    @functools.cached_property
    def dialect(self) -> str:  # type: ignore[override]
        return self.engine.dialect.name

    def _fail(self, exc: Exception) -> StoreError:
        return StoreError(f"django store ({self.using}): {exc.__class__.__name__}: {exc}")

    @contextmanager
    def _errors(self) -> Iterator[None]:
        # django.db.Error, not only DatabaseError: InterfaceError ("connection already closed" after a
        # database restart) is its sibling, and callers (the sweep's mark_sent retry) retry StoreError.
        try:
            yield
        except (DjangoDbError, sa.exc.SQLAlchemyError) as exc:
            self._drop_broken_connection(exc)
            raise self._fail(exc) from exc

    def _drop_broken_connection(self, exc: Exception) -> None:
        """Close a connection the error left unusable, so the next call (a retry) reconnects.

        Django reconnects only when it has no connection: a dead one is reused until closed, and
        ``atomic()`` closes it only when its own rollback fails. Statement-level errors leave the
        connection fine; inside the caller's own transaction Django's ``atomic`` exit deals with it
        (closing there would break the caller's block).
        """
        if isinstance(exc, (DataError, IntegrityError, sa.exc.DataError, sa.exc.IntegrityError)):
            return
        connection = connections[self.using]
        if connection.in_atomic_block:
            return
        try:
            if isinstance(exc, (InterfaceError, sa.exc.InterfaceError)) or getattr(
                exc, "connection_invalidated", False
            ):
                connection.close()  # a connection-level error by definition ("connection already closed")
            else:
                # What Django's cursor wrapper records for its own errors: the check below then runs
                # one "SELECT 1" and closes the connection if that fails too.
                connection.errors_occurred = True
                connection.close_if_unusable_or_obsolete()
        except DjangoDbError:
            # close() forgets the connection even when closing it fails (it is dead anyway)
            with suppress(DjangoDbError):
                connection.close()

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        with self._errors(), transaction.atomic(using=self.using), self.engine.connect() as conn:
            yield conn

    def now(self) -> datetime:
        with self._begin() as conn:
            return self._db_now(conn)

    def close(self) -> None:
        connections[self.using].close()
