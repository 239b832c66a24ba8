"""The SQL store's table: its columns, indexes per dialect, the MySQL/MariaDB variant and upgrades."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection

from .... import constants as C
from ....clock import UTC, as_utc
from ....exceptions import StoreError
from ..base import query

logger = logging.getLogger(__name__)

#: Binary, no-pad collations keep ids and keys exact as on PostgreSQL/SQLite ("a", "A", "a " differ).
MARIADB_COLLATION = "utf8mb4_nopad_bin"
MYSQL_COLLATION = "utf8mb4_0900_bin"
#: Named lock (GET_LOCK) that serializes table creation between processes starting at once.
MYSQL_SCHEMA_LOCK = "celery_safe_time_schema"
MYSQL_SCHEMA_LOCK_TIMEOUT = 30


#: Dialects whose datetime columns have no time zone: values are bound as naive UTC.
_NAIVE_DATETIME_DIALECTS = frozenset({"sqlite"}) | C.MYSQL_DIALECTS


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, on every dialect.

    SQLite keeps naive text, so values are converted to UTC before they are bound; the
    text then sorts in time order, which the due-at comparisons rely on. MySQL/MariaDB get
    naive UTC in ``DATETIME(6)``: a plain ``DATETIME`` would round away the microseconds.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in C.MYSQL_DIALECTS:
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        if getattr(dialect, "native_datetime", False):
            # SQLite through Django's connection (the Django store), which converts datetimes itself.
            return dialect.type_descriptor(sa.TIMESTAMP())
        return super().load_dialect_impl(dialect)

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise StoreError(f"naive datetime {value!r} given to the store; pass aware UTC datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name in _NAIVE_DATETIME_DIALECTS else value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


def _columns() -> list[sa.Column[Any]]:
    """The table's columns, fresh objects per call (a Column belongs to one Table)."""
    return [
        sa.Column("id", sa.String(C.DELAY_ID_LENGTH), primary_key=True),
        sa.Column("task", sa.String(C.DELAY_TASK_LENGTH), nullable=False),
        # MySQL's BLOB stops at 64 KiB; LONGBLOB matches bytea / SQLite BLOB (and Django's BinaryField).
        sa.Column("payload", sa.LargeBinary().with_variant(mysql.LONGBLOB(), *C.MYSQL_DIALECTS), nullable=False),
        sa.Column("content_type", sa.String(C.DELAY_CONTENT_TYPE_LENGTH), nullable=False),
        sa.Column("content_encoding", sa.String(C.DELAY_ENCODING_LENGTH), nullable=False),
        sa.Column("due_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(C.DELAY_KEY_LENGTH), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, default=0),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.Column("claimed_at", UTCDateTime, nullable=True),
        sa.Column("claim_token", sa.String(64), nullable=True),
        sa.Column("sent_at", UTCDateTime, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        # the delivery record: who started the row's run, its heartbeat and how it ended
        sa.Column("delivery_token", sa.String(C.DELIVERY_TOKEN_LENGTH), nullable=True),
        sa.Column("started_at", UTCDateTime, nullable=True),
        sa.Column("heartbeat_at", UTCDateTime, nullable=True),
        sa.Column("finished_at", UTCDateTime, nullable=True),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("worker", sa.String(C.DELIVERY_WORKER_LENGTH), nullable=True),
        sa.Column("started_by", sa.String(C.DELIVERY_TOKEN_LENGTH), nullable=True),
        sa.Column("starts", sa.Integer, nullable=False, server_default="0", default=0),
        sa.Column("suspected_at", UTCDateTime, nullable=True),
        # ``safe_time_store_namespace`` of the app that stored the row ("" from a store built by hand)
        sa.Column(
            "namespace",
            sa.String(C.DELAY_NAMESPACE_LENGTH),
            nullable=False,
            server_default=C.SHARED_STORE_NAMESPACE,
            default=C.SHARED_STORE_NAMESPACE,
        ),
        # a debounced row's cap: later calls of its burst never move it past this time
        sa.Column("debounce_until", UTCDateTime, nullable=True),
    ]


# The queries of every dialect use this table; its indexes are the PostgreSQL/SQLite schema.
metadata = sa.MetaData()
delays = sa.Table(C.DELAY_TABLE, metadata, *_columns())
_PENDING_SQL = sa.text(query("pending_rows", "schema.sql"))
#: The indexes but the pending key's: their columns, and the rows each holds as a partial index
#: (predicates in schema.sql), so each scan reads only the rows of its status. The last one is the
#: purge's: finished rows by age, so millions of them are trimmed a batch at a time without a scan; its
#: predicate is an expression, not text: the DDL compiler renders its values inline.
_INDEXES = (
    (C.DELAY_DUE_INDEX, ("due_at", "id"), _PENDING_SQL),
    (C.DELAY_CLAIMED_INDEX, ("claimed_at",), sa.text(query("claimed_rows", "schema.sql"))),
    (C.DELAY_SENT_INDEX, ("sent_at",), sa.text(query("sent_rows", "schema.sql"))),
    (C.DELAY_STARTED_INDEX, ("heartbeat_at",), sa.text(query("started_rows", "schema.sql"))),
    (C.DELAY_UPDATED_INDEX, ("updated_at",), delays.c.status.in_(sorted(C.PURGEABLE_STATUSES))),
)
for _name, _indexed, _where in _INDEXES:
    sa.Index(_name, *(delays.c[c] for c in _indexed), postgresql_where=_where, sqlite_where=_where)
sa.Index(
    C.DELAY_KEY_INDEX,
    delays.c.idempotency_key,
    unique=True,
    postgresql_where=_PENDING_SQL,
    sqlite_where=_PENDING_SQL,
)

# MySQL/MariaDB have no partial indexes. The pending-only unique key becomes a UNIQUE index on a
# generated column that is NULL unless the row is pending (NULLs never collide); the others lead
# with status, so each scan still touches only rows of its status.
_MYSQL_PENDING_KEY_SQL = query("pending_key_mysql", "schema.sql")
#: Table-less on purpose: it renders as the bare column name inside queries on ``delays``.
mysql_pending_key = sa.column(C.DELAY_PENDING_KEY_COLUMN, sa.String(C.DELAY_KEY_LENGTH))


def _mysql_metadata(*, mariadb: bool) -> sa.MetaData:
    """The MySQL/MariaDB DDL of the table (its collation differs between the two servers)."""
    meta = sa.MetaData()
    table = sa.Table(
        C.DELAY_TABLE,
        meta,
        *_columns(),
        sa.Column(
            C.DELAY_PENDING_KEY_COLUMN,
            sa.String(C.DELAY_KEY_LENGTH),
            sa.Computed(_MYSQL_PENDING_KEY_SQL, persisted=True),
        ),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mysql_collate=MARIADB_COLLATION if mariadb else MYSQL_COLLATION,
    )
    for name, indexed, _where in _INDEXES:
        sa.Index(name, table.c.status, *(table.c[c] for c in indexed))
    sa.Index(C.DELAY_KEY_INDEX, table.c[C.DELAY_PENDING_KEY_COLUMN], unique=True)
    return meta


def schema_for(conn: Connection) -> sa.MetaData:
    if conn.dialect.name in C.MYSQL_DIALECTS:
        return _mysql_metadata(mariadb=bool(getattr(conn.dialect, "is_mariadb", False)))
    return metadata


@contextmanager
def mysql_schema_lock(conn: Connection) -> Iterator[None]:
    """Serialize table creation between processes (MySQL DDL commits at once, so no transaction lock)."""
    params = {"name": MYSQL_SCHEMA_LOCK, "timeout": MYSQL_SCHEMA_LOCK_TIMEOUT}
    got = conn.execute(sa.text(query("lock_schema_mysql")), params).scalar()
    if got != 1:
        # Go on unlocked: a racing CREATE fails with "already exists", handled by ensure_schema.
        logger.warning("store schema lock %s not taken within %ss", MYSQL_SCHEMA_LOCK, MYSQL_SCHEMA_LOCK_TIMEOUT)
    try:
        yield
    finally:
        if got == 1:
            conn.execute(sa.text(query("unlock_schema_mysql")), {"name": MYSQL_SCHEMA_LOCK})


def status_is(value: str) -> sa.ColumnElement[bool]:
    # Inline the constant so PostgreSQL can match the partial index even with generic plans.
    return delays.c.status == sa.literal(value, literal_execute=True)
