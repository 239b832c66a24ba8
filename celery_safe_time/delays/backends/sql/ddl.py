"""The delay table's schema as :class:`~.store.SQLAlchemyStore` keeps it: created on first use,
checked on MySQL, dropped for tests."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .... import constants as C
from ....config import mask_url
from ....exceptions import StoreError
from ..base import query
from .schema import metadata, mysql_schema_lock, schema_for


class StoreSchema:
    """The schema half of :class:`~.store.SQLAlchemyStore`, whose ``__init__`` sets these attributes."""

    url: str
    engine: Engine
    dialect: str
    _schema_ready: bool
    _schema_lock: threading.Lock

    if TYPE_CHECKING:  # SQLStore's, which follows this mixin in SQLAlchemyStore's bases

        @property
        def _is_mysql(self) -> bool: ...

        def _fail(self, exc: Exception) -> StoreError: ...

    def ensure_schema(self) -> None:
        """Create the table and its indexes if they are missing (once per process)."""
        if self._schema_ready:
            return
        with self._schema_lock:
            if self._schema_ready:
                return
            try:
                with self.engine.begin() as conn:
                    if self.dialect == "postgresql":
                        # Several processes start at once; serialize the DDL instead of racing.
                        conn.execute(sa.text(query("lock_schema_postgresql")), {"key": C.DELAY_SCHEMA_LOCK_KEY})
                    if self._is_mysql:
                        with mysql_schema_lock(conn):
                            schema_for(conn).create_all(conn, checkfirst=True)
                    else:
                        metadata.create_all(conn, checkfirst=True)
            except sa.exc.OperationalError as exc:
                # SQLite (or MySQL without its schema lock): another process created it between
                # the check and the CREATE.
                if not self._column_names():  # no such table
                    raise self._fail(exc) from exc
            except sa.exc.SQLAlchemyError as exc:
                raise self._fail(exc) from exc
            if self._is_mysql:
                self._check_mysql_schema()
            self._schema_ready = True

    def _column_names(self) -> set[str]:
        """The table's column names; empty when they cannot be read (or there is no table)."""
        try:
            found = sa.inspect(self.engine).get_columns(C.DELAY_TABLE)
        except sa.exc.SQLAlchemyError:
            return set()
        return {str(item["name"]) for item in found}

    def _check_mysql_schema(self) -> None:
        """Refuse a table made without the pending-key column (e.g. by Django's migrations): its
        idempotency key would be unique across all rows and its times whole seconds."""
        if C.DELAY_PENDING_KEY_COLUMN not in self._column_names():
            raise StoreError(
                f"store {mask_url(self.url)}: table {C.DELAY_TABLE} has no {C.DELAY_PENDING_KEY_COLUMN} column; "
                "it was not created by this store version: move its rows elsewhere and drop it to have it recreated"
            )

    def drop_schema(self) -> None:
        """Drop the table (tests and benchmarks)."""
        with self.engine.begin() as conn:
            schema_for(conn).drop_all(conn, checkfirst=True)
        self._schema_ready = False
