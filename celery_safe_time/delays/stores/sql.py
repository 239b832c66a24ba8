"""SQLAlchemy Core store for PostgreSQL, SQLite and MySQL/MariaDB."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.interfaces import DBAPIModule
from sqlalchemy.ext.compiler import compiles

from ... import constants as C
from ...clock import UTC, as_utc
from ...config import mask_url
from ...exceptions import StoreError
from .base import (
    NOW_SQL,
    DelayRow,
    DelayStore,
    InsertResult,
    NewDelay,
    StartResult,
    early_by,
    empty_counts,
    new_delivery_token,
    refused,
    start_verdict,
    started_values,
    truncate_error,
)

logger = logging.getLogger(__name__)


#: URL prefixes without a driver -> the driver this package installs (extras ``postgres``, ``mysql``).
_DEFAULT_DRIVERS = {
    "postgres://": "postgresql+psycopg://",
    "postgresql://": "postgresql+psycopg://",
    "mysql://": "mysql+pymysql://",
    "mariadb://": "mariadb+pymysql://",
}


def normalize_url(url: str) -> str:
    """Pick the drivers this package installs: psycopg 3 for PostgreSQL, PyMySQL for MySQL/MariaDB."""
    for prefix, replacement in _DEFAULT_DRIVERS.items():
        if url.startswith(prefix):
            return replacement + url[len(prefix) :]
    return url


def deadline_args(url: str, timeout: float) -> dict[str, Any]:
    """The driver's connect arguments that give every call on a connection of ``url`` a deadline of
    ``timeout`` seconds (``safe_time_store_timeout``), so that a hung network path or a stuck server
    ends in an error instead of a call that never returns.

    PostgreSQL (libpq): ``statement_timeout`` (the server cancels a statement that runs or waits
    longer), ``tcp_user_timeout`` (data sent and not acknowledged for that long: the connection is
    dropped) and keepalive probes (a silent peer on an idle connection counts as gone within it).
    MySQL/MariaDB (PyMySQL): read and write timeouts on the socket. SQLite: none (a local file).
    """
    millis = max(1, int(timeout * 1000))
    if url.startswith("postgresql"):
        probe = max(1, int(timeout / (C.STORE_KEEPALIVE_COUNT + 1)))
        return {
            "keepalives": 1,
            "keepalives_idle": probe,
            "keepalives_interval": probe,
            "keepalives_count": C.STORE_KEEPALIVE_COUNT,
            "tcp_user_timeout": millis,
            "options": f"-c statement_timeout={millis}",
        }
    if url.startswith(("mysql", "mariadb")):
        seconds = max(1, math.ceil(timeout))
        return {"read_timeout": seconds, "write_timeout": seconds}
    return {}


def create_engine(url: str, *, timeout: float | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url``; ``timeout``: :func:`deadline_args` on every connection (None: none).

    ``connect_args`` given here are added to the package's (libpq ``options`` are joined)."""
    url = normalize_url(url)
    options: dict[str, Any] = {"pool_pre_ping": True, "future": True}
    connect: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # One writer at a time; wait for it instead of failing at once.
        connect = {"timeout": 30}
    elif url.startswith("postgresql"):
        connect = {"connect_timeout": C.DB_CONNECT_TIMEOUT}
    elif url.startswith(("mysql", "mariadb")):
        connect = {"connect_timeout": C.DB_CONNECT_TIMEOUT}
        options["isolation_level"] = C.MYSQL_ISOLATION_LEVEL
    for extra in (deadline_args(url, timeout) if timeout else {}, kwargs.pop("connect_args", None) or {}):
        for name, value in extra.items():
            joined = name == "options" and connect.get("options")
            connect[name] = f"{connect['options']} {value}" if joined else value
    options["connect_args"] = connect
    options.update(kwargs)
    try:
        return sa.create_engine(url, **options)
    except (ImportError, sa.exc.ArgumentError) as exc:
        raise StoreError(f"cannot create a store engine for {mask_url(url)}: {exc}") from exc


def load_driver(url: str) -> Any:
    """Import the DBAPI module ``url`` uses (psycopg, PyMySQL, sqlite3) without connecting."""
    return sa.engine.make_url(normalize_url(url)).get_dialect().import_dbapi()


def _now_sql(dialect: str) -> sa.TextClause:
    query = NOW_SQL.get(dialect)
    if query is None:  # pragma: no cover - guarded by the settings check
        raise StoreError(f"unsupported store dialect {dialect!r}")
    return sa.text(query)


def database_now(engine: Engine) -> datetime:
    """The database server's clock, as an aware UTC datetime."""
    query = _now_sql(engine.dialect.name)
    try:
        with engine.connect() as conn:
            value = conn.execute(query).scalar_one()
    except sa.exc.SQLAlchemyError as exc:
        raise StoreError(f"store {mask_url(str(engine.url))} unreachable: {exc.__class__.__name__}: {exc}") from exc
    return as_utc(value)


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
        *_delivery_columns(),
        *_namespace_columns(),
    ]


def _delivery_columns() -> list[sa.Column[Any]]:
    """The delivery record's columns; added to an older table by :meth:`SQLAlchemyStore.ensure_schema`."""
    return [
        sa.Column("delivery_token", sa.String(C.DELIVERY_TOKEN_LENGTH), nullable=True),
        sa.Column("started_at", UTCDateTime, nullable=True),
        sa.Column("heartbeat_at", UTCDateTime, nullable=True),
        sa.Column("finished_at", UTCDateTime, nullable=True),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("worker", sa.String(C.DELIVERY_WORKER_LENGTH), nullable=True),
        sa.Column("started_by", sa.String(C.DELIVERY_TOKEN_LENGTH), nullable=True),
        sa.Column("starts", sa.Integer, nullable=False, server_default="0", default=0),
        sa.Column("suspected_at", UTCDateTime, nullable=True),
    ]


def _namespace_columns() -> list[sa.Column[Any]]:
    """``safe_time_store_namespace`` of the app that stored the row; "" on rows of an older table."""
    return [
        sa.Column(
            "namespace",
            sa.String(C.DELAY_NAMESPACE_LENGTH),
            nullable=False,
            server_default=C.LEGACY_STORE_NAMESPACE,
            default=C.LEGACY_STORE_NAMESPACE,
        ),
    ]


def _added_columns() -> list[sa.Column[Any]]:
    """Columns added after the first release: :meth:`SQLAlchemyStore.ensure_schema` adds the missing ones."""
    return [*_delivery_columns(), *_namespace_columns()]


# The queries of every dialect use this table; its indexes are the PostgreSQL/SQLite schema.
metadata = sa.MetaData()
delays = sa.Table(C.DELAY_TABLE, metadata, *_columns())
_PENDING_SQL = sa.text("status = 'pending'")
_CLAIMED_SQL = sa.text("status = 'claimed'")
# Partial indexes: the sweep's claim only ever reads pending rows in due order, so the index
# stays as small as the backlog no matter how many sent rows the table keeps.
sa.Index(C.DELAY_DUE_INDEX, delays.c.due_at, delays.c.id, postgresql_where=_PENDING_SQL, sqlite_where=_PENDING_SQL)
sa.Index(
    C.DELAY_KEY_INDEX,
    delays.c.idempotency_key,
    unique=True,
    postgresql_where=_PENDING_SQL,
    sqlite_where=_PENDING_SQL,
)
sa.Index(C.DELAY_CLAIMED_INDEX, delays.c.claimed_at, postgresql_where=_CLAIMED_SQL, sqlite_where=_CLAIMED_SQL)
# The delivery confirmation scans: rows sent but never started, rows started whose heartbeat stopped.
_SENT_SQL = sa.text("status = 'sent'")
_STARTED_SQL = sa.text("status = 'started'")
sa.Index(C.DELAY_SENT_INDEX, delays.c.sent_at, postgresql_where=_SENT_SQL, sqlite_where=_SENT_SQL)
sa.Index(C.DELAY_STARTED_INDEX, delays.c.heartbeat_at, postgresql_where=_STARTED_SQL, sqlite_where=_STARTED_SQL)
# The purge: finished rows by age, so a table of millions of finished rows is trimmed one batch at a
# time without scanning it (nor the pending rows, however old).
# An expression, not text: the DDL compiler renders its values inline (the index's predicate).
_FINISHED_SQL = delays.c.status.in_(sorted(C.PURGEABLE_STATUSES))
sa.Index(C.DELAY_UPDATED_INDEX, delays.c.updated_at, postgresql_where=_FINISHED_SQL, sqlite_where=_FINISHED_SQL)
#: Indexes an earlier version's table may lack; created at store start (:meth:`SQLAlchemyStore.upgrade_schema`).
_LATER_INDEXES = (C.DELAY_SENT_INDEX, C.DELAY_STARTED_INDEX, C.DELAY_UPDATED_INDEX)

# MySQL/MariaDB have no partial indexes. The pending-only unique key becomes a UNIQUE index on a
# generated column that is NULL unless the row is pending (NULLs never collide); the other two lead
# with status, so the claim and the stale-claim scan still touch only rows of their status.
_MYSQL_PENDING_KEY_SQL = "CASE WHEN status = 'pending' THEN idempotency_key END"
#: Table-less on purpose: it renders as the bare column name inside queries on ``delays``.
_mysql_pending_key = sa.column(C.DELAY_PENDING_KEY_COLUMN, sa.String(C.DELAY_KEY_LENGTH))


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
        mysql_collate=C.MARIADB_COLLATION if mariadb else C.MYSQL_COLLATION,
    )
    sa.Index(C.DELAY_DUE_INDEX, table.c.status, table.c.due_at, table.c.id)
    sa.Index(C.DELAY_KEY_INDEX, table.c[C.DELAY_PENDING_KEY_COLUMN], unique=True)
    sa.Index(C.DELAY_CLAIMED_INDEX, table.c.status, table.c.claimed_at)
    sa.Index(C.DELAY_SENT_INDEX, table.c.status, table.c.sent_at)
    sa.Index(C.DELAY_STARTED_INDEX, table.c.status, table.c.heartbeat_at)
    sa.Index(C.DELAY_UPDATED_INDEX, table.c.status, table.c.updated_at)
    return meta


def _schema_for(conn: Connection) -> sa.MetaData:
    if conn.dialect.name in C.MYSQL_DIALECTS:
        return _mysql_metadata(mariadb=bool(getattr(conn.dialect, "is_mariadb", False)))
    return metadata


@contextmanager
def _mysql_schema_lock(conn: Connection) -> Iterator[None]:
    """Serialize table creation between processes (MySQL DDL commits at once, so no transaction lock)."""
    params = {"name": C.MYSQL_SCHEMA_LOCK, "timeout": C.MYSQL_SCHEMA_LOCK_TIMEOUT}
    got = conn.execute(sa.text("SELECT GET_LOCK(:name, :timeout)"), params).scalar()
    if got != 1:
        # Go on unlocked: a racing CREATE fails with "already exists", handled by ensure_schema.
        logger.warning("store schema lock %s not taken within %ss", C.MYSQL_SCHEMA_LOCK, C.MYSQL_SCHEMA_LOCK_TIMEOUT)
    try:
        yield
    finally:
        if got == 1:
            conn.execute(sa.text("SELECT RELEASE_LOCK(:name)"), {"name": C.MYSQL_SCHEMA_LOCK})


def _status(value: str) -> sa.ColumnElement[bool]:
    # Inline the constant so PostgreSQL can match the partial index even with generic plans.
    return delays.c.status == sa.literal(value, literal_execute=True)


class AddColumn(sa.schema.ExecutableDDLElement):
    """``ALTER TABLE ... ADD COLUMN ...`` (SQLAlchemy Core has no construct of its own for it)."""

    inherit_cache = False

    def __init__(self, table: sa.Table, column: sa.Column[Any]) -> None:
        self.table = table
        self.column = column


@compiles(AddColumn)
def _compile_add_column(element: AddColumn, compiler: Any, **_: Any) -> str:
    table = compiler.preparer.format_table(element.table)
    # Identifiers quoted by the dialect's preparer; the column's DDL from the dialect's own compiler.
    column = compiler.get_column_specification(element.column)
    return f"ALTER TABLE {table} ADD COLUMN {column}"


#: "Now" in a statement: the store's time read before it, or the database's clock inside it.
Now = datetime | sa.ColumnElement[Any]


def _ago(now: Now, seconds: float) -> Any:
    if isinstance(now, datetime):
        return now - timedelta(seconds=seconds)
    return now - sa.literal(timedelta(seconds=seconds), sa.Interval())


def _stale_heartbeat(now: Now, stale_after: float) -> sa.ColumnElement[bool]:
    t = delays
    return sa.or_(t.c.heartbeat_at.is_(None), t.c.heartbeat_at < _ago(now, stale_after))


def _suspect(now: Now, stale_after: float) -> sa.ColumnElement[bool]:
    """Started, heartbeat stale, not suspected since its last heartbeat (see ``DelayRow.suspected_at``)."""
    t = delays
    return sa.and_(
        _status(C.STATUS_STARTED),
        _stale_heartbeat(now, stale_after),
        sa.or_(t.c.suspected_at.is_(None), t.c.heartbeat_at > t.c.suspected_at),
    )


def _dead(now: Now, stale_after: float) -> sa.ColumnElement[bool]:
    """Suspected more than ``stale_after`` ago, with no heartbeat since."""
    t = delays
    return sa.and_(
        _status(C.STATUS_STARTED),
        t.c.suspected_at < _ago(now, stale_after),
        sa.or_(t.c.heartbeat_at.is_(None), t.c.heartbeat_at <= t.c.suspected_at),
    )


def _older(before: datetime, statuses: frozenset[str]) -> sa.ColumnElement[bool]:
    """Rows of ``statuses`` last changed before ``before``: what a purge deletes."""
    # Inlined statuses, as in _status(): PostgreSQL then proves the partial index's predicate.
    wanted = [sa.literal(s, literal_execute=True) for s in sorted(statuses)]
    return sa.and_(delays.c.status.in_(wanted), delays.c.updated_at < before)


def _bind(name: str, type_: Any = None) -> sa.BindParameter[Any]:
    """A value given at each run of a statement compiled once (:class:`_RecordWrites`)."""
    return sa.bindparam(name, type_=type_, required=False)


def _start_update(
    task_id: Any,
    token: Any,
    run_id: Any,
    worker: Any,
    now: Now,
    stale_after: float,
    takeover: sa.ColumnElement[bool] | None,
    starts: sa.ColumnElement[Any],
    leeway: float = math.inf,
) -> sa.Update:
    """The conditional start that decides the one run: a row not started yet, or a started one whose run
    is dead or matches ``takeover`` (run ids of this delivery's earlier copies).

    Values are Python values or binds (:func:`_bind`). ``starts`` is the new start count: MySQL applies
    SET assignments left to right, so an expression there that reads ``started_by`` would see the new one.
    """
    t = delays
    taken_over = sa.or_(_dead(now, stale_after), *([takeover] if takeover is not None else []))
    unstarted: sa.ColumnElement[bool] = t.c.status.in_(sorted(C.DELAY_STARTABLE_STATUSES))
    if math.isfinite(leeway):
        # Not before it is due by the store's clock: a message published ahead with its eta reaches
        # a worker whose clock is fast too soon.
        unstarted = sa.and_(unstarted, t.c.due_at <= _ago(now, -leeway))
    return (
        sa.update(t)
        .where(
            t.c.id == task_id,
            t.c.delivery_token == token,
            sa.or_(unstarted, sa.and_(_status(C.STATUS_STARTED), taken_over)),
        )
        .values(**started_values(now, worker, run_id), starts=starts, updated_at=now)
    )


def _running(task_id: Any, token: Any, run_id: Any) -> sa.ColumnElement[bool]:
    t = delays
    return sa.and_(t.c.id == task_id, t.c.delivery_token == token, _status(C.STATUS_STARTED), t.c.started_by == run_id)


def _heartbeat_update(task_id: Any, token: Any, run_id: Any, now: Now) -> sa.Update:
    return sa.update(delays).where(_running(task_id, token, run_id)).values(heartbeat_at=now)


def _prepared_heartbeat() -> sa.Update:
    return _heartbeat_update(_bind("task_id"), _bind("token"), _bind("run_id"), sa.func.clock_timestamp())


def _finish_update(task_id: Any, token: Any, run_id: Any, now: Now, outcome: Any, last_error: Any) -> sa.Update:
    """The end of the run ``run_id``; ``last_error`` None keeps the column as it is."""
    values: dict[str, Any] = {"status": C.STATUS_FINISHED, "outcome": outcome, "finished_at": now, "updated_at": now}
    if last_error is not None:
        values["last_error"] = last_error
    return sa.update(delays).where(_running(task_id, token, run_id)).values(**values)


def _hand_back_update(task_id: Any, token: Any, run_id: Any, now: Now) -> sa.Update:
    """The run ``run_id`` gave its message back to the broker: startable again by that message."""
    values = {"status": C.STATUS_SENT, "sent_at": now, "suspected_at": None, "updated_at": now}
    return sa.update(delays).where(_running(task_id, token, run_id)).values(**values)


def _prepared_hand_back() -> sa.Update:
    return _hand_back_update(_bind("task_id"), _bind("token"), _bind("run_id"), sa.func.clock_timestamp())


class _RecordWrites:
    """PostgreSQL: the delivery record's per-task writes (start, heartbeat, end), each a statement
    compiled once and sent as it is on a pooled psycopg connection in autocommit.

    Each stored task makes two of them, so what SQLAlchemy does around one statement costs more than
    the statement: building the construct and its cache key, the execution context, and a pre-ping
    round trip per checkout. The same SQL text each time also lets psycopg prepare it on the server
    (after ``prepare_threshold`` runs). Two pools: ``engines[True]`` waits for the WAL flush,
    ``engines[False]`` has ``synchronous_commit=off``.

    No pre-ping: a pooled connection the server closed (a restart, an idle timeout) fails on its
    statement instead; the pool is emptied and the statement sent once more on a new connection. Every
    statement here is safe to send twice: a start names its own run id among those it may take over
    (and counts once), a heartbeat sets a time, an end that already landed leaves nothing to change.
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
            # render_postcompile: the inlined literals (_status) become part of the text.
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
        raise AssertionError("unreachable")  # pragma: no cover - the second pass returns or raises


class SQLAlchemyStore(DelayStore):
    """Delayed tasks in a SQL table, claimed with ``FOR UPDATE SKIP LOCKED`` where the database has it.

    The table is created on first use (``CREATE TABLE``/``CREATE INDEX`` if missing); Django
    projects get the same table from the contrib app's migrations instead.
    """

    def __init__(self, url: str, *, engine: Engine | None = None, timeout: float | None = None) -> None:
        self.url = url
        self.engine = engine if engine is not None else create_engine(url, timeout=timeout)
        self.dialect = self.engine.dialect.name
        # A server database's pool is thread-safe: the sweep claims its next batch in a thread. Not
        # SQLite's (one writer, and an in-memory database is one per thread's connection).
        self.claims_in_background = self.dialect != "sqlite"
        #: Same pool; each checkout in autocommit (reset when it goes back to the pool).
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        #: PostgreSQL: the delivery record's per-task writes, on pools of their own (see _RecordWrites).
        self._record_writes = (
            _RecordWrites(self.engine.url.render_as_string(hide_password=False), timeout)
            if self.dialect == "postgresql"
            else None
        )
        #: PostgreSQL: autocommit connections with ``synchronous_commit=off`` (an engine opens no
        #: connection until used).
        self._unflushed_engine: Engine | None = (
            self._record_writes.engines[False] if self._record_writes is not None else None
        )

    # --- plumbing ----------------------------------------------------------------

    def now(self) -> datetime:
        return database_now(self.engine)

    def ping(self) -> None:
        self.now()

    def close(self) -> None:
        self.engine.dispose()
        if self._record_writes is not None:
            self._record_writes.dispose()

    def _fail(self, exc: Exception) -> StoreError:
        return StoreError(f"store {mask_url(self.url)}: {exc.__class__.__name__}: {exc}")

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        """One short transaction; database errors become :class:`StoreError`."""
        self.ensure_schema()
        try:
            with self.engine.begin() as conn:
                yield conn
        except sa.exc.SQLAlchemyError as exc:
            raise self._fail(exc) from exc

    def _db_now(self, conn: Connection) -> datetime:
        return as_utc(conn.execute(_now_sql(self.dialect)).scalar_one())

    def _sweep_clock(self) -> AbstractContextManager[tuple[Connection, Any]]:
        """A connection and "now" for the sweep's claim and its mark sent / expired / failed / released.

        PostgreSQL: one autocommit statement with ``statement_timestamp()`` as now, so a claim or a
        batch's mark sent is one round trip (not BEGIN, the clock, the statement, COMMIT: four). A
        single UPDATE is atomic on its own, and the claim's ``FOR UPDATE SKIP LOCKED`` holds its locks
        for that statement, which is all the claim needs. ``statement_timestamp()`` (not
        ``clock_timestamp()``) because it is stable: the claim's ``due_at <= now + look-ahead`` stays an
        index bound, and every row of one statement gets the same time.
        """
        return self._one_statement(sa.type_coerce(sa.func.statement_timestamp(), UTCDateTime))

    def _statement_clock(self) -> AbstractContextManager[tuple[Connection, Now]]:
        """A connection and "now" for the delivery record's writes where no :class:`_RecordWrites` runs
        them (SQLite, MySQL/MariaDB; a start that lost, on PostgreSQL): ``clock_timestamp()`` inside
        the statement on PostgreSQL."""
        return self._one_statement(sa.func.clock_timestamp())

    @contextmanager
    def _one_statement(self, postgres_now: Now) -> Iterator[tuple[Connection, Now]]:
        """PostgreSQL: an autocommit connection, ``postgres_now`` evaluated by the server inside the
        statement (one conditional UPDATE is atomic on its own). Elsewhere: one short transaction that
        reads the database's clock first, like every other write here."""
        if self.dialect != "postgresql":
            with self._begin() as conn:
                yield conn, self._db_now(conn)
            return
        self.ensure_schema()
        try:
            with self._autocommit.connect() as conn:
                yield conn, postgres_now
        except sa.exc.SQLAlchemyError as exc:
            raise self._fail(exc) from exc

    def _record_write(
        self,
        writes: _RecordWrites,
        key: Hashable,
        build: Callable[[], sa.Update],
        params: dict[str, Any],
        *,
        durable: bool,
    ) -> int:
        """Rows changed by one per-task write of the delivery record (PostgreSQL); errors become StoreError."""
        self.ensure_schema()
        try:
            return writes.rowcount(key, build, params, durable=durable)
        except (sa.exc.SQLAlchemyError, writes.dbapi_error) as exc:
            raise self._fail(exc) from exc

    def _in_scope(self) -> sa.ColumnElement[bool]:
        """Rows of this store's namespace and legacy ones (every row for a store without one)."""
        scope = self.scope
        return sa.true() if scope is None else delays.c.namespace.in_(scope)

    @property
    def _is_mysql(self) -> bool:
        return self.dialect in C.MYSQL_DIALECTS

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
                        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": 0x5AFE7133})
                    if self._is_mysql:
                        with _mysql_schema_lock(conn):
                            _schema_for(conn).create_all(conn, checkfirst=True)
                    else:
                        metadata.create_all(conn, checkfirst=True)
            except sa.exc.OperationalError as exc:
                # SQLite (or MySQL without its schema lock): another process created it between
                # the check and the CREATE.
                if not self._has_table():
                    raise self._fail(exc) from exc
            except sa.exc.SQLAlchemyError as exc:
                raise self._fail(exc) from exc
            if self._is_mysql:
                self._check_mysql_schema()
            self._upgrade_schema()
            self._schema_ready = True

    def _upgrade_schema(self) -> None:
        """Add the delivery record's and the namespace's columns, and the later indexes, to a table made
        by an earlier version. Existing rows get namespace "" (legacy): every app's sweep still claims them."""
        try:
            inspector = sa.inspect(self.engine)
            names = {col["name"] for col in inspector.get_columns(C.DELAY_TABLE)}
            missing = [col for col in _added_columns() if col.name not in names]
            indexes = {index["name"] for index in inspector.get_indexes(C.DELAY_TABLE)}
            if not missing and all(name in indexes for name in _LATER_INDEXES):
                return
            with self.engine.begin() as conn:
                if self.dialect == "postgresql":
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": 0x5AFE7133})
                    names = {col["name"] for col in sa.inspect(conn).get_columns(C.DELAY_TABLE)}
                schema = _schema_for(conn).tables[C.DELAY_TABLE]
                for col in missing:
                    if col.name not in names:
                        conn.execute(AddColumn(schema, schema.c[col.name]))
                for index in schema.indexes:
                    if index.name in _LATER_INDEXES and index.name not in indexes:
                        index.create(conn, checkfirst=True)
            logger.warning(
                "store %s: upgraded %s (columns added: %s; indexes added: %s)",
                mask_url(self.url),
                C.DELAY_TABLE,
                ", ".join(col.name for col in missing) or "none",
                ", ".join(name for name in _LATER_INDEXES if name not in indexes) or "none",
            )
        except sa.exc.SQLAlchemyError as exc:
            if self._has_columns() and self._has_indexes():
                return  # another process upgraded it meanwhile
            raise self._fail(exc) from exc

    def _has_columns(self) -> bool:
        try:
            names = {col["name"] for col in sa.inspect(self.engine).get_columns(C.DELAY_TABLE)}
        except sa.exc.SQLAlchemyError:
            return False
        return all(col.name in names for col in _added_columns())

    def _has_indexes(self) -> bool:
        try:
            names = {index["name"] for index in sa.inspect(self.engine).get_indexes(C.DELAY_TABLE)}
        except sa.exc.SQLAlchemyError:
            return False
        return all(name in names for name in _LATER_INDEXES)

    def upgrade_schema(self) -> None:
        """Bring the table of an earlier version up to date now (``celery safe-time delays upgrade-schema``).

        The same upgrade runs once per process at the store's first use; this runs it on demand, e.g.
        from a deploy step, so that the ``CREATE INDEX`` on a big table does not happen in a worker.
        """
        self._schema_ready = False
        self.ensure_schema()

    def _check_mysql_schema(self) -> None:
        """Refuse a table made without the pending-key column (e.g. by Django's migrations or an
        older version): its idempotency key would be unique across all rows and its times whole seconds."""
        try:
            names = {col["name"] for col in sa.inspect(self.engine).get_columns(C.DELAY_TABLE)}
        except sa.exc.SQLAlchemyError as exc:
            raise self._fail(exc) from exc
        if C.DELAY_PENDING_KEY_COLUMN not in names:
            raise StoreError(
                f"store {mask_url(self.url)}: table {C.DELAY_TABLE} has no {C.DELAY_PENDING_KEY_COLUMN} column; "
                "it was not created by this store version: move its rows elsewhere and drop it to have it recreated"
            )

    def _has_table(self) -> bool:
        try:
            return bool(sa.inspect(self.engine).has_table(C.DELAY_TABLE))
        except sa.exc.SQLAlchemyError:
            return False

    def drop_schema(self) -> None:
        """Drop the table (tests and benchmarks)."""
        with self.engine.begin() as conn:
            _schema_for(conn).drop_all(conn, checkfirst=True)
        self._schema_ready = False

    # --- writes --------------------------------------------------------------------

    def insert(self, delay: NewDelay) -> InsertResult:
        # Fast path, one short transaction: [key lookup,] now, INSERT. A unique violation (the task
        # id is taken, or a concurrent call won the idempotency key) takes the careful path.
        try:
            return self._insert(delay, careful=False)
        except StoreError as exc:
            if not isinstance(exc.__cause__, sa.exc.IntegrityError):
                raise
        return self._insert(delay, careful=True)

    def _insert(self, delay: NewDelay, *, careful: bool) -> InsertResult:
        with self._begin() as conn:
            return self._insert_on(conn, delay, careful=careful)

    def _insert_on(
        self, conn: Connection, delay: NewDelay, *, careful: bool, now: datetime | None = None
    ) -> InsertResult:
        t = delays
        if delay.idempotency_key is not None:
            found = conn.execute(
                sa.select(t.c.id, t.c.due_at).where(self._pending_key_is(delay.idempotency_key), self._in_scope())
            ).first()
            if found is not None:
                return InsertResult(found.id, created=False, due_at=found.due_at)
        if careful:
            existing = conn.execute(sa.select(t.c.status).where(t.c.id == delay.id)).scalar()
            if existing is not None:
                if existing not in C.DELAY_REPLACEABLE_STATUSES:
                    raise StoreError(f"task id {delay.id!r} is already stored and {existing}")
                # retry() reuses its task id: the finished (or running) row makes room for the new one.
                conn.execute(sa.delete(t).where(t.c.id == delay.id, t.c.status.in_(C.DELAY_REPLACEABLE_STATUSES)))
        values = self.new_row(delay, now if now is not None else self._db_now(conn))
        conn.execute(sa.insert(t).values(**values))
        return InsertResult(delay.id, created=True, due_at=values["due_at"])

    def insert_many(self, delays: Sequence[NewDelay]) -> list[InsertResult]:
        if not delays:
            return []
        # Fast path: the keys looked up in a few queries, every row in a few multi-row INSERTs. A unique
        # violation (a task id taken, in the store or twice in the batch; a key won meanwhile) rolls it
        # back and takes the careful path: row by row, in one transaction again.
        try:
            with self._begin() as conn:
                return self._insert_many_fast(conn, delays)
        except StoreError as exc:
            if not isinstance(exc.__cause__, sa.exc.IntegrityError):
                raise
        with self._begin() as conn:
            now = self._db_now(conn)
            results: list[InsertResult] = []
            for index, delay in enumerate(delays):
                try:
                    results.append(self._insert_on(conn, delay, careful=True, now=now))
                except StoreError as exc:
                    raise refused(index, str(exc)) from exc
            return results

    def _insert_many_fast(self, conn: Connection, batch: Sequence[NewDelay]) -> list[InsertResult]:
        t = delays
        held: dict[str, tuple[str, datetime]] = {}
        keys = sorted({d.idempotency_key for d in batch if d.idempotency_key is not None})
        key_column = _mysql_pending_key if self._is_mysql else t.c.idempotency_key
        for start in range(0, len(keys), C.BULK_KEY_LOOKUP):
            chunk = keys[start : start + C.BULK_KEY_LOOKUP]
            query = sa.select(key_column, t.c.id, t.c.due_at).where(key_column.in_(chunk))
            if not self._is_mysql:
                query = query.where(_status(C.STATUS_PENDING))
            query = query.where(self._in_scope())
            for key, task_id, due_at in conn.execute(query).all():
                held[key] = (task_id, as_utc(due_at))
        now = self._db_now(conn)
        results: list[InsertResult] = []
        rows: list[dict[str, Any]] = []
        for delay in batch:
            key = delay.idempotency_key
            if key is not None and key in held:
                results.append(InsertResult(held[key][0], created=False, due_at=held[key][1]))
                continue
            values = self.new_row(delay, now)
            rows.append(values)
            if key is not None:
                held[key] = (delay.id, values["due_at"])
            results.append(InsertResult(delay.id, created=True, due_at=values["due_at"]))
        for start in range(0, len(rows), C.BULK_INSERT_CHUNK):
            conn.execute(sa.insert(t), rows[start : start + C.BULK_INSERT_CHUNK])
        return results

    def _pending_key_is(self, key: str) -> sa.ColumnElement[bool]:
        """The pending row holding ``key``, through the dialect's unique index."""
        if self._is_mysql:
            return _mysql_pending_key == key
        return sa.and_(delays.c.idempotency_key == key, _status(C.STATUS_PENDING))

    def bulk_insert(self, rows: Sequence[NewDelay], *, chunk: int = 5000) -> None:
        """Insert many pending rows fast (benchmarks and tests); no idempotency handling."""
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            for start in range(0, len(rows), chunk):
                conn.execute(sa.insert(t), [self.new_row(d, now) for d in rows[start : start + chunk]])

    def cancel(self, task_id: str) -> bool:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            result = conn.execute(
                sa.update(t)
                .where(t.c.id == task_id, t.c.status.in_(sorted(C.DELAY_CANCELLABLE_STATUSES)), self._in_scope())
                .values(status=C.STATUS_CANCELLED, claim_token=None, updated_at=now)
            )
            return bool(result.rowcount)

    def reschedule(self, task_id: str, due_at: datetime) -> bool:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            result = conn.execute(
                sa.update(t)
                .where(t.c.id == task_id, t.c.status.in_(sorted(C.DELAY_CANCELLABLE_STATUSES)), self._in_scope())
                .values(
                    due_at=due_at,
                    status=C.STATUS_PENDING,
                    claim_token=None,
                    delivery_token=new_delivery_token(),
                    updated_at=now,
                )
            )
            return bool(result.rowcount)

    # --- the delivery record ---------------------------------------------------------

    def start(
        self,
        task_id: str,
        token: str,
        run_id: str,
        worker: str,
        *,
        stale_after: float,
        prior_runs: Sequence[str] = (),
        leeway: float = math.inf,
    ) -> StartResult:
        t = delays
        worker = worker[: C.DELIVERY_WORKER_LENGTH]
        writes = self._record_writes
        if writes is not None:
            # This run's own id is among the run ids it may take over: a start sent again after its
            # reply was lost (_RecordWrites) wins again, and counts once.
            params = {
                "task_id": task_id,
                "token": token,
                "run_id": run_id,
                "worker": worker,
                "takeover": [*prior_runs, run_id],
            }

            def build() -> sa.Update:
                own = _bind("run_id")
                return _start_update(
                    _bind("task_id"),
                    _bind("token"),
                    own,
                    _bind("worker"),
                    sa.func.clock_timestamp(),
                    stale_after,
                    takeover=t.c.started_by == sa.any_(_bind("takeover", postgresql.ARRAY(sa.String))),
                    starts=sa.case((t.c.started_by == own, t.c.starts), else_=t.c.starts + 1),
                    leeway=leeway,
                )

            if self._record_write(writes, ("start", stale_after, leeway), build, params, durable=True) == 1:
                return StartResult("run")
            with self._statement_clock() as (conn, now):
                return self._lost_start(conn, now, task_id, token, stale_after, leeway)
        with self._statement_clock() as (conn, now):
            takeover = t.c.started_by.in_(list(prior_runs)) if prior_runs else None
            started = _start_update(
                task_id, token, run_id, worker, now, stale_after, takeover, t.c.starts + 1, leeway=leeway
            )
            if conn.execute(started).rowcount == 1:
                return StartResult("run")
            return self._lost_start(conn, now, task_id, token, stale_after, leeway)

    def _lost_start(
        self, conn: Connection, now: Now, task_id: str, token: str, stale_after: float, leeway: float = math.inf
    ) -> StartResult:
        """Why a start did not win; a stale heartbeat seen here for the first time becomes a suspicion."""
        t = delays
        conn.execute(
            sa.update(t)
            .where(t.c.id == task_id, t.c.delivery_token == token, _suspect(now, stale_after))
            .values(suspected_at=now)
        )
        mapping = conn.execute(sa.select(t).where(t.c.id == task_id)).mappings().first()
        row = None if mapping is None else DelayRow.from_mapping(mapping)
        early = 0.0
        if math.isfinite(leeway) and row is not None and row.status in C.DELAY_STARTABLE_STATUSES:
            early = early_by(row, now if isinstance(now, datetime) else self._db_now(conn), leeway)
        return StartResult(start_verdict(row, token, early), row, early)

    def heartbeat(self, task_id: str, token: str, run_id: str) -> bool:
        writes = self._record_writes
        if writes is not None:
            # Not flushed: a heartbeat a crash forgets is followed by the next one, lock_ttl / 3 later.
            params = {"task_id": task_id, "token": token, "run_id": run_id}
            return bool(self._record_write(writes, ("heartbeat",), _prepared_heartbeat, params, durable=False))
        with self._statement_clock() as (conn, now):
            return bool(conn.execute(_heartbeat_update(task_id, token, run_id, now)).rowcount)

    def finish(
        self, task_id: str, token: str, run_id: str, outcome: str, error: str | None = None, *, durable: bool = True
    ) -> bool:
        last_error = None if error is None else truncate_error(error)
        writes = self._record_writes
        if writes is not None:
            params = {"task_id": task_id, "token": token, "run_id": run_id, "outcome": outcome}
            if last_error is not None:
                params["last_error"] = last_error

            def build() -> sa.Update:
                error_bind = None if last_error is None else _bind("last_error")
                return _finish_update(
                    _bind("task_id"),
                    _bind("token"),
                    _bind("run_id"),
                    sa.func.clock_timestamp(),
                    _bind("outcome"),
                    error_bind,
                )

            key = ("finish", last_error is not None)
            return bool(self._record_write(writes, key, build, params, durable=durable))
        with self._statement_clock() as (conn, now):
            return bool(conn.execute(_finish_update(task_id, token, run_id, now, outcome, last_error)).rowcount)

    def hand_back(self, task_id: str, token: str, run_id: str) -> bool:
        writes = self._record_writes
        if writes is not None:
            params = {"task_id": task_id, "token": token, "run_id": run_id}
            return bool(self._record_write(writes, ("hand_back",), _prepared_hand_back, params, durable=True))
        with self._statement_clock() as (conn, now):
            return bool(conn.execute(_hand_back_update(task_id, token, run_id, now)).rowcount)

    def requeue_unstarted(self, grace: float) -> int:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            cutoff = now - timedelta(seconds=grace)
            result = conn.execute(
                sa.update(t)
                .where(_status(C.STATUS_SENT), t.c.sent_at < cutoff, t.c.due_at < cutoff, self._in_scope())
                .values(status=C.STATUS_PENDING, updated_at=now)
            )
            return int(result.rowcount)

    def stale_started(self, stale_after: float, limit: int) -> list[DelayRow]:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            query = (
                sa.select(t)
                .where(_status(C.STATUS_STARTED), _stale_heartbeat(now, stale_after), self._in_scope())
                .order_by(t.c.heartbeat_at, t.c.id)
                .limit(limit)
            )
            return [DelayRow.from_mapping(m) for m in conn.execute(query).mappings()]

    def end_stale(self, task_id: str, token: str, stale_after: float, *, rerun: bool) -> bool:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            values: dict[str, Any] = (
                {"status": C.STATUS_PENDING, "suspected_at": None}
                if rerun
                else {"status": C.STATUS_FINISHED, "outcome": C.OUTCOME_INTERRUPTED, "finished_at": now}
            )
            mine = sa.and_(t.c.id == task_id, t.c.delivery_token == token)
            result = conn.execute(sa.update(t).where(mine, _dead(now, stale_after)).values(updated_at=now, **values))
            if result.rowcount:
                return True
            conn.execute(sa.update(t).where(mine, _suspect(now, stale_after)).values(suspected_at=now))
            return False

    # --- the sweep -------------------------------------------------------------------

    def claim_query(self, *, limit: int, horizon: datetime | sa.ColumnElement[Any]) -> sa.Select[Any]:
        """The ``SELECT ... FOR UPDATE SKIP LOCKED`` that picks due rows (also used by EXPLAIN)."""
        t = delays
        query = (
            sa.select(t.c.id)
            .where(_status(C.STATUS_PENDING), t.c.due_at <= horizon, self._in_scope())
            .order_by(t.c.due_at, t.c.id)
            .limit(limit)
        )
        if self.dialect != "sqlite":
            query = query.with_for_update(skip_locked=True)
        return query

    def claim_due(self, *, limit: int, lookahead: float, token: str) -> list[DelayRow]:
        t = delays
        with self._sweep_clock() as (conn, now):
            ahead = timedelta(seconds=lookahead)
            # An SQL now takes the look-ahead as an interval (bound as a timestamp it would not convert).
            horizon = now + (sa.literal(ahead, sa.Interval()) if isinstance(now, sa.ColumnElement) else ahead)
            picked = self.claim_query(limit=limit, horizon=horizon)
            values = {
                "status": C.STATUS_CLAIMED,
                "claim_token": token,
                "claimed_at": now,
                "updated_at": now,
                "attempts": t.c.attempts + 1,
                # Rows stored before the delivery record get a token now (unique with the row's id).
                "delivery_token": sa.func.coalesce(t.c.delivery_token, token),
            }
            if self.engine.dialect.update_returning:
                # PostgreSQL, SQLite: one statement (SQLite holds its single write lock for it).
                # The pick is a CTE, evaluated once: as an IN (subquery) PostgreSQL may re-run it
                # per row, and with SKIP LOCKED each run can return other rows (more than LIMIT).
                cte = picked.cte("picked")
                result = conn.execute(
                    sa.update(t).where(t.c.id == cte.c.id, _status(C.STATUS_PENDING)).values(**values).returning(*t.c)
                )
                # Plain tuples zipped with the column names: a driver's row mapping is slow to copy, and
                # this runs in the claim thread, whose CPU the publishing thread waits for (the GIL).
                keys = list(result.keys())
                rows = [DelayRow.from_mapping(dict(zip(keys, r, strict=True))) for r in result]
            else:
                # MySQL/MariaDB (no UPDATE ... RETURNING, and no UPDATE ... IN (SELECT ... LIMIT)):
                # lock the ids first with SKIP LOCKED, then update and read them, same transaction.
                ids = list(conn.execute(picked).scalars())
                if not ids:
                    return []
                conn.execute(sa.update(t).where(t.c.id.in_(ids)).values(**values))
                rows = [DelayRow.from_mapping(m) for m in conn.execute(sa.select(t).where(t.c.id.in_(ids))).mappings()]
        rows.sort(key=lambda r: (r.due_at, r.id))
        return rows

    def pending_ahead(self, horizon: datetime, limit: int) -> tuple[int, datetime | None]:
        t = delays
        # The claim's index, read up to ``limit`` entries: the count costs no more than that many rows.
        picked = (
            sa.select(t.c.due_at)
            .where(_status(C.STATUS_PENDING), t.c.due_at <= horizon, self._in_scope())
            .order_by(t.c.due_at, t.c.id)
            .limit(limit)
            .subquery()
        )
        query = sa.select(sa.func.count(), sa.type_coerce(sa.func.max(picked.c.due_at), UTCDateTime))
        with self._begin() as conn:
            count, last = conn.execute(query).one()
        return int(count), None if last is None else as_utc(last)

    def _finish(self, task_ids: Sequence[str], token: str, *, status: str, **values: Any) -> int:
        if not task_ids:
            return 0
        t = delays
        with self._sweep_clock() as (conn, now):
            values.setdefault("updated_at", now)
            if values.get("sent_at") is True:
                values["sent_at"] = now
            result = conn.execute(
                sa.update(t)
                .where(t.c.id.in_(list(task_ids)), _status(C.STATUS_CLAIMED), t.c.claim_token == token)
                .values(claim_token=None, status=status, **values)
            )
            return int(result.rowcount)

    def reclaim_stale(self, timeout: float) -> int:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            result = conn.execute(
                sa.update(t)
                .where(_status(C.STATUS_CLAIMED), t.c.claimed_at < now - timedelta(seconds=timeout), self._in_scope())
                .values(status=C.STATUS_PENDING, claim_token=None, updated_at=now)
            )
            return int(result.rowcount)

    # --- retention ---------------------------------------------------------------------

    def _purgeable(self, before: datetime, statuses: frozenset[str]) -> int:
        query = sa.select(sa.func.count()).select_from(delays).where(_older(before, statuses), self._in_scope())
        with self._begin() as conn:
            return int(conn.execute(query).scalar_one())

    def _purge(self, before: datetime, statuses: frozenset[str], limit: int) -> int:
        t = delays
        old = sa.and_(_older(before, statuses), self._in_scope())
        if self._is_mysql:
            # MySQL/MariaDB refuse LIMIT inside an IN (subquery) but take DELETE ... LIMIT.
            query = sa.delete(t).where(old).with_dialect_options(mysql_limit=limit, mariadb_limit=limit)
        else:
            picked = sa.select(t.c.id).where(old).limit(limit).scalar_subquery()
            # The outer filter repeats the age and status: a row replaced meanwhile (retry() reuses
            # its task id) must not be deleted as the finished row it was.
            query = sa.delete(t).where(t.c.id.in_(picked), old)
        with self._begin() as conn:
            return int(conn.execute(query).rowcount)

    # --- reads -------------------------------------------------------------------------

    def get(self, task_id: str) -> DelayRow | None:
        with self._begin() as conn:
            query = sa.select(delays).where(delays.c.id == task_id, self._in_scope())
            mapping = conn.execute(query).mappings().first()
        return None if mapping is None else DelayRow.from_mapping(mapping)

    def list(
        self,
        *,
        status: str | None = None,
        task: str | None = None,
        due_before: datetime | None = None,
        limit: int = 100,
    ) -> list[DelayRow]:
        t = delays
        query = sa.select(t).where(self._in_scope()).order_by(t.c.due_at, t.c.id).limit(limit)
        if status is not None:
            query = query.where(t.c.status == status)
        if task is not None:
            query = query.where(t.c.task == task)
        if due_before is not None:
            query = query.where(t.c.due_at <= due_before)
        with self._begin() as conn:
            return [DelayRow.from_mapping(m) for m in conn.execute(query).mappings()]

    def counts(self) -> dict[str, int]:
        counts = empty_counts()
        with self._begin() as conn:
            for status, count in conn.execute(
                sa.select(delays.c.status, sa.func.count()).where(self._in_scope()).group_by(delays.c.status)
            ).all():
                counts[status] = int(count)
        return counts

    def oldest_due(self, status: str = C.STATUS_PENDING) -> datetime | None:
        with self._begin() as conn:
            query = sa.select(sa.func.min(delays.c.due_at)).where(_status(status), self._in_scope())
            value = conn.execute(query).scalar()
        # min() loses the column type on some dialects: normalise here.
        return None if value is None else as_utc(value)
