"""Overlap locks, idempotency markers and unique keys as PostgreSQL rows (``safe_time_coordination_url``).

Tables ``safe_time_lock``, ``safe_time_lock_marker``, ``safe_time_unique`` and the fence sequence,
created on first use (``locks/sql/schema.sql``; every statement in ``locks/sql/queries.sql``). Names
are the Redis key names, every time is the database's ``now()``, and the Redis scripts' rules are
PL/pgSQL functions, so each lock call is one statement on an autocommit connection. Expired rows are
replaced when their name is taken again and purged every ``PG_LOCK_PURGE_INTERVAL`` seconds.

``safe_time_coordination_locks``: ``lease`` (:class:`PostgresLockBackend`, the default) rows expire
``ttl`` after their last renewal, as on Redis, and work behind PgBouncer in transaction mode;
``session`` (:class:`PostgresSessionLockBackend`) holds ``pg_try_advisory_lock`` on a connection kept
for the run, freed the moment that connection dies, but not behind PgBouncer in transaction mode and
never for a holder that hangs (docs/locks.md).
"""

from __future__ import annotations

import fnmatch
import logging
import re
import select
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

from ... import constants as C
from ...config import SafeTimeConfig, mask_url
from ...coordination import coordination_engine, postgres_url
from ...exceptions import CoordinationUnavailable
from ..rates import Rate, RateTaken
from . import postgres_sql
from .base import (
    Acquired,
    Holder,
    HolderRecord,
    LockBackend,
    LockInfo,
    Owner,
    RateCount,
    UniqueClaim,
    as_ms,
)
from .postgres_sql import QUERIES

logger = logging.getLogger(__name__)

#: One process deletes expired lock, marker and unique rows at most this often (seconds), a batch at a time.
PG_LOCK_PURGE_INTERVAL = 60.0

T = TypeVar("T")


class _Call:
    """One of the statements a held lock makes (acquire, renew, release, commit), in two forms.

    ``libpq``: sent with ``PGconn.exec_params`` on the pooled psycopg connection, parameters and
    results as text. psycopg's ``Cursor`` around each call (a transformer, a dumper per parameter,
    a ``Column`` per result column) costs two to three times the client CPU of the call itself, and on a
    loaded worker CPU time is what a lock pays for most. ``pyformat``: the same statement through the
    driver's cursor, where that fast path does not apply (another driver, or gevent/eventlet, where a
    blocking libpq call would stall every green thread; psycopg's cursor waits cooperatively there).
    Every parameter is cast in the SQL: libpq sends them untyped.
    """

    __slots__ = ("columns", "libpq", "pyformat")

    def __init__(self, sql: str, columns: str = "") -> None:
        self.libpq = sql.encode()
        self.pyformat = re.sub(r"\$\d+", "%s", sql)
        #: The Python type of each result column (``s`` text, ``i`` integer, ``b`` boolean).
        self.columns = columns


_ACQUIRE = _Call(QUERIES["acquire"], "sibssi")
_RENEW = _Call(QUERIES["renew"])
_RELEASE = _Call(QUERIES["release"], "b")
_COMMIT = _Call(QUERIES["commit"], "bb")

#: The ``:name`` statements, as ``sqlalchemy.text``.
_SQL = {name: sa.text(sql) for name, sql in QUERIES.items()}
_PURGE = [_SQL[name] for name in ("purge_markers", "purge_unique", "purge_rates", "purge_locks")]

#: Errors that mean the database could not be reached (or the connection broke), not a bad statement.
_UNREACHABLE = (sa.exc.OperationalError, sa.exc.InterfaceError)


def _like_prefix(pattern: str) -> str:
    """A LIKE pattern matching every name that starts with ``pattern``'s text before its first glob
    character (``fnmatch`` then filters exactly)."""
    literal = pattern
    for i, char in enumerate(pattern):
        if char in "*?[":
            literal = pattern[:i]
            break
    escaped = literal.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return escaped + "%"


def _text_param(value: Any, encoding: str) -> bytes | None:
    """A :class:`_Call` parameter in PostgreSQL's text format."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, (list, tuple)):
        quoted = ('"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"' for v in value)
        return ("{" + ",".join(quoted) + "}").encode(encoding)
    return str(value).encode(encoding)


def _wait_for(fd: int, events: int, deadline: float) -> bool:
    """Until ``fd`` is ready for ``events`` (poll: no FD_SETSIZE limit as select has), or until
    ``deadline`` (``time.monotonic()``): False when it passed first."""
    poller = select.poll()
    poller.register(fd, events | select.POLLERR | select.POLLHUP)
    left = deadline - time.monotonic()
    return left > 0 and bool(poller.poll(left * 1000.0))


def _text_value(raw: bytes | None, kind: str, encoding: str) -> Any:
    """A result column of a :class:`_Call` (text format) as Python: ``kind`` is s, i or b."""
    if raw is None:
        return None
    if kind == "i":
        return int(raw)
    if kind == "b":
        return raw == b"t"
    return raw.decode(encoding)


class PostgresLockBackend(LockBackend):
    """Lease-row locks on the coordination database: see the module docstring."""

    kind = "postgres"
    label = "PostgreSQL"
    #: Whether overlap locks are session advisory locks (:class:`PostgresSessionLockBackend`).
    session = False

    def __init__(self, config: SafeTimeConfig, engine: sa.Engine | None = None) -> None:
        self.config = config
        # Autocommit, no pre-ping: each call is one statement, one round trip; a connection the
        # pool kept past a database restart fails once and the call is repeated on a new one.
        self.engine = engine or coordination_engine(config, autocommit=True)
        self._next_purge = 0.0
        #: Whether this store's schema is known to exist (saves rendering the URL on every call).
        self._schema_checked = False
        #: Whether :class:`_Call`s go through libpq directly (decided at the first call, see _fast).
        self._libpq: bool | None = None

    def describe(self) -> str:
        return f"PostgreSQL {mask_url(str(self.engine.url))}, safe_time_coordination_url"

    # --- plumbing -------------------------------------------------------------------------------
    def ensure_schema(self) -> None:
        """Create the tables, sequence and functions unless this database has them (once per process)."""
        if self._schema_checked:
            return
        try:
            if postgres_sql.ensure_schema(self.engine):
                logger.info("created the PostgreSQL lock tables and functions")
        except _UNREACHABLE as exc:
            raise self._unreachable(exc) from exc
        self._schema_checked = True

    def _run(self, work: Callable[[sa.Connection], T]) -> T:
        """``work`` on a pooled connection; a connection that broke (a restart since it was pooled)
        is thrown away and ``work`` runs once more: every call here is safe to repeat (token-checked)."""
        for attempt in (1, 2):
            try:
                self.ensure_schema()
                with self.engine.connect() as conn:
                    return work(conn)
            except sa.exc.DBAPIError as exc:
                if attempt == 1 and exc.connection_invalidated:
                    continue
                if isinstance(exc, _UNREACHABLE):
                    raise self._unreachable(exc) from exc
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _unreachable(self, exc: BaseException) -> CoordinationUnavailable:
        return CoordinationUnavailable(f"{self.describe()} unreachable: {exc}")

    def _dbapi_errors(self) -> tuple[type[Exception], tuple[type[Exception], ...]]:
        """The driver's base error and the ones that mean the server could not be reached."""
        dbapi = self.engine.dialect.loaded_dbapi
        return dbapi.Error, (dbapi.OperationalError, dbapi.InterfaceError)

    def _raw_checkout(self) -> Any:
        """A pooled DBAPI connection (no SQLAlchemy ``Connection`` around it: the lock calls are one
        statement each, and that wrapper costs about as much as the round trip)."""
        self.ensure_schema()
        unreachable: tuple[type[Exception], ...] = (*self._dbapi_errors()[1], *_UNREACHABLE)
        try:
            return self.engine.raw_connection()
        except unreachable as exc:
            raise self._unreachable(exc) from exc

    def _fast(self, conn: Any) -> Any:
        """The libpq connection under the pooled DBAPI connection ``conn`` when :class:`_Call`'s fast
        path applies to this engine (psycopg 3, no green threads), else None."""
        if self._libpq is None:
            from ..concurrency import green_threads

            self._libpq = self.engine.dialect.driver == "psycopg" and not green_threads()
        return conn.driver_connection if self._libpq else None

    def _result(self, driver: Any, call: _Call, args: tuple[Any, ...]) -> Any:
        """``call`` on the psycopg connection ``driver`` through libpq: the PGresult (raised as the
        cursor would raise it when the statement failed)."""
        from psycopg import errors, pq

        encoding = driver.info.encoding
        pgconn = driver.pgconn
        timeout = self.config.coordination_io_timeout
        deadline = time.monotonic() + timeout
        pgconn.send_query_params(call.libpq, [_text_param(arg, encoding) for arg in args])
        # The waits are here, not in a blocking libpq call (PQexecParams): a signal (a soft time limit,
        # a warm shutdown) then interrupts a call to a database that stopped answering, as it does
        # psycopg's own wait, and a database (or proxy) that stopped answering fails the call at the
        # deadline. psycopg keeps its connections non-blocking, so flush what is left.
        while pgconn.flush():
            if not _wait_for(pgconn.socket, select.POLLOUT, deadline):
                raise self._no_answer(driver, timeout)
        result = None
        while True:
            while pgconn.is_busy():
                if not _wait_for(pgconn.socket, select.POLLIN, deadline):
                    raise self._no_answer(driver, timeout)
                pgconn.consume_input()
            got = pgconn.get_result()
            if got is None:
                break
            if result is None:  # one statement, one result; the loop reads libpq's end marker
                result = got
        if result is None or result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            if result is None:
                raise errors.OperationalError("the lock statement returned no result")
            raise errors.error_from_result(result, encoding=encoding)
        return result

    @staticmethod
    def _no_answer(driver: Any, timeout: float) -> Exception:
        """The error of a lock statement unanswered for ``timeout`` s; ``driver`` is closed first (a
        reply may still come), so the pool throws the connection away (a disconnect)."""
        from psycopg import errors

        driver.close()
        return errors.OperationalError(
            f"no answer from PostgreSQL within {timeout:g} s (safe_time_coordination_io_timeout)"
        )

    def _fetch(self, conn: Any, call: _Call, args: tuple[Any, ...]) -> Any:
        """Run ``call`` on the pooled DBAPI connection ``conn``: its first row, or None (no rows)."""
        driver = self._fast(conn)
        if driver is None:
            with conn.cursor() as cursor:
                cursor.execute(call.pyformat, args)
                return cursor.fetchone() if cursor.description is not None else None
        result = self._result(driver, call, args)
        if not result.ntuples:
            return None
        encoding = driver.info.encoding
        return tuple(_text_value(result.get_value(0, i), kind, encoding) for i, kind in enumerate(call.columns))

    def _rowcount(self, conn: Any, call: _Call, args: tuple[Any, ...]) -> int:
        driver = self._fast(conn)
        if driver is None:
            with conn.cursor() as cursor:
                cursor.execute(call.pyformat, args)
                return int(cursor.rowcount)
        return int(self._result(driver, call, args).command_tuples or 0)

    def _run_raw(self, work: Callable[[Any], T]) -> T:
        """:meth:`_run` on a pooled DBAPI connection: a connection that broke is thrown away and
        ``work`` runs once more (every call here is token-checked, so safe to repeat)."""
        error, unreachable = self._dbapi_errors()
        for attempt in (1, 2):
            conn = self._raw_checkout()
            try:
                result = work(conn)
            except error as exc:
                disconnected = self.engine.dialect.is_disconnect(exc, conn.dbapi_connection, None)  # type: ignore[arg-type]
                if disconnected:
                    conn.invalidate()
                conn.close()
                if attempt == 1 and disconnected:
                    continue
                if isinstance(exc, unreachable):
                    raise self._unreachable(exc) from exc
                raise
            except BaseException:
                conn.invalidate()  # a statement may still be running on it
                conn.close()
                raise
            conn.close()
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _maybe_purge(self) -> None:
        now = time.monotonic()
        if now < self._next_purge:
            return
        self._next_purge = now + PG_LOCK_PURGE_INTERVAL

        def purge(conn: sa.Connection) -> int:
            return sum(conn.execute(query).rowcount for query in _PURGE)

        try:
            purged = self._run(purge)
        except Exception as exc:  # housekeeping must never fail a task
            logger.warning("could not purge expired lock rows: %s", exc)
            return
        if purged:
            logger.debug("purged %d expired lock rows", purged)

    # --- ownership ------------------------------------------------------------------------------
    def _acquire_on(self, conn: Any, key: str, token: str, ttl: float, owner: Owner,
                    marker: str | None, earlier_tokens: tuple[str, ...]) -> Acquired:  # fmt: skip
        """Run the acquire function on the DBAPI connection ``conn``."""
        args = (
            self.lock_key(key),
            self.done_key(key, owner.identity),
            self.marker_key(marker) if marker is not None else None,
            token,
            as_ms(ttl),
            owner.task_id,
            owner.host,
            owner.pid,
            owner.identity,
            list(earlier_tokens),
            self.session,
        )
        row = self._fetch(conn, _ACQUIRE, args)
        status, fence, own, task_id, host, pid = row
        if status == "acquired":
            return Acquired("acquired", fence=int(fence), took_over=bool(own))
        if status in ("done", "finished"):
            return Acquired(status)
        holder = Holder(task_id=task_id, host=host, pid=pid, fence=fence)
        return Acquired("duplicate" if status == "duplicate" else "held", holder=holder)

    def _acquire_lease(
        self, key: str, token: str, ttl: float, owner: Owner, marker: str | None, earlier_tokens: tuple[str, ...]
    ) -> Acquired:
        return self._run_raw(lambda conn: self._acquire_on(conn, key, token, ttl, owner, marker, earlier_tokens))

    def renew(self, key: str, token: str, ttl: float) -> bool:
        args = (as_ms(ttl), self.lock_key(key), token)
        return bool(self._run_raw(lambda conn: self._rowcount(conn, _RENEW, args)))

    def _release_params(self, key: str, token: str, finished: tuple[str, float, str] | None) -> tuple[Any, ...]:
        """(name, token, done marker, task id, done ms): the release's parameters."""
        if finished is None:
            return (self.lock_key(key), token, None, None, None)
        identity, ttl, task_id = finished
        return (self.lock_key(key), token, self.done_key(key, identity), task_id, as_ms(ttl))

    def release(self, key: str, token: str, finished: tuple[str, float, str] | None = None) -> bool:
        params = self._release_params(key, token, finished)
        released = bool(self._run_raw(lambda conn: self._fetch(conn, _RELEASE, params)[0]))
        self._maybe_purge()
        return released

    def _commit_params(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None
    ) -> tuple[Any, ...]:
        """(lock, marker, token, window ms, task id, done marker, done ms): the commit's parameters."""
        done, done_ms = (None, None) if finished is None else (self.done_key(lock, finished[0]), as_ms(finished[1]))
        return (self.lock_key(lock), self.marker_key(marker), token, as_ms(window), task_id, done, done_ms)

    def commit(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None = None
    ) -> tuple[bool, bool]:
        params = self._commit_params(lock, marker, token, window, task_id, finished)
        recorded, released = self._run_raw(lambda conn: self._fetch(conn, _COMMIT, params))
        self._maybe_purge()
        return bool(recorded), bool(released)

    def holder_record(self, key: str) -> HolderRecord | None:
        row = self._run(lambda conn: conn.execute(_SQL["holder"], {"name": self.lock_key(key)}).first())
        return (row[0], row[1], row[2], row[3]) if row is not None else None

    def idempotent_done(self, key: str) -> bool:
        name = self.marker_key(key)
        return self._run(lambda conn: conn.execute(_SQL["marker_live"], {"name": name}).first()) is not None

    # --- unique task keys -------------------------------------------------------------------------
    def _unique_acquire(
        self, key: str, task: str, ttl: float, state: str, stored: bool | None, host: str, gone: str | None, own: bool
    ) -> UniqueClaim:
        params = {
            "name": self.unique_key(key),
            "task_id": task,
            "ttl_ms": as_ms(ttl),
            "state": state,
            "stored": stored,
            "host": host,
            "gone": gone,
            "own": own,
        }
        status, holder, held_state, held_stored, ms_left = self._run(
            lambda conn: conn.execute(_SQL["unique_acquire"], params).one()
        )
        if status in ("acquired", "own"):
            return UniqueClaim(status)
        return UniqueClaim(
            "held",
            holder=holder,
            state=held_state or None,
            stored=bool(held_stored),
            ttl_left=ms_left / 1000.0 if ms_left is not None and ms_left >= 0 else None,
        )

    def rate_take(self, key: str, token: str, rate: Rate, *, reserve: bool = True) -> RateTaken:
        params = {
            "name": self.rate_key(key),
            "token": token,
            "limit": rate.limit,
            "period_us": max(1, int(rate.period * 1_000_000)),
            "reserve": reserve,
        }
        admitted, count, wait_us, at = self._run(lambda conn: conn.execute(_SQL["rate_take"], params).one())
        self._maybe_purge()
        return RateTaken(bool(admitted), int(wait_us) / 1_000_000, int(count), float(at))

    def rate_release(self, key: str, token: str) -> bool:
        params = {"name": self.rate_key(key), "token": token}
        return bool(self._run(lambda conn: conn.execute(_SQL["rate_release"], params).rowcount))

    def rate_counts(self, pattern: str = "*", *, limit: int | None = None) -> list[RateCount]:
        """One query over ``safe_time_rate`` (its rows hold their own expiry: start plus period),
        bounded to ``C.RATE_SCAN_KEYS`` keys."""
        head = self.rate_key("")
        params = {"like": _like_prefix(head + pattern), "keys": C.RATE_SCAN_KEYS}
        rows = self._run(lambda conn: list(conn.execute(_SQL["rate_counts"], params).all()))
        found = [
            RateCount(name[len(head) :], int(started), int(waiting))
            for name, started, waiting in rows
            if fnmatch.fnmatchcase(name[len(head) :], pattern) and (started or waiting)
        ]
        return found[:limit] if limit is not None else found

    def unique_release(self, key: str, task_id: str) -> bool:
        params = {"name": self.unique_key(key), "task_id": task_id}
        released = bool(self._run(lambda conn: conn.execute(_SQL["unique_release"], params).rowcount))
        self._maybe_purge()
        return released

    def _unique_info(self, row: Any) -> LockInfo:
        name, task_id, host, state, age, ttl_left = row[:6]
        key = name[len(self.unique_key("")) :]
        return LockInfo.unique(key, name, task_id, host, round(age, 3), round(ttl_left, 3), state)

    def unique_info(self, key: str, now: float) -> LockInfo | None:
        row = self._run(lambda conn: conn.execute(_SQL["unique_info"], {"name": self.unique_key(key)}).first())
        return self._unique_info(row) if row is not None else None

    def scan_unique(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        head = self.unique_key("")
        like = _like_prefix(head + pattern)
        rows = self._run(lambda conn: conn.execute(_SQL["unique_scan"], {"like": like}).all())
        found = sorted(
            (self._unique_info(row) for row in rows if fnmatch.fnmatchcase(row[0][len(head) :], pattern)),
            key=lambda i: i.key,
        )
        return found[:limit] if limit is not None else found

    def force_release_unique(self, key: str) -> LockInfo | None:
        row = self._run(lambda conn: conn.execute(_SQL["unique_force_release"], {"name": self.unique_key(key)}).first())
        return self._unique_info(row) if row is not None and row[6] else None

    # --- operator view ----------------------------------------------------------------------------
    def _lock_info(self, row: Any) -> LockInfo:
        name, task_id, host, pid, fence, age, ttl_left = row[:7]
        return LockInfo(
            key=self.user_key(name),
            redis_key=name,
            task_id=task_id,
            host=host,
            pid=pid,
            fence=fence,
            age=round(age, 3),
            ttl_left=round(ttl_left, 3) if ttl_left is not None else None,
        )

    def _held_rows(self, rows: list[Any]) -> list[Any]:
        """Rows whose lock is held: every live row of a lease lock."""
        return rows

    def info(self, redis_key: str, now: float) -> LockInfo | None:
        rows = self._held_rows(self._run(lambda conn: list(conn.execute(_SQL["info"], {"name": redis_key}).all())))
        return self._lock_info(rows[0]) if rows else None

    def scan(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        like = _like_prefix(self.lock_key(pattern))
        rows = self._held_rows(self._run(lambda conn: list(conn.execute(_SQL["scan"], {"like": like}).all())))
        found = sorted(
            (self._lock_info(row) for row in rows if fnmatch.fnmatchcase(self.user_key(row[0]), pattern)),
            key=lambda i: i.key,
        )
        return found[:limit] if limit is not None else found

    def force_release(self, key: str) -> LockInfo | None:
        rows = self._run(lambda conn: conn.execute(_SQL["force_release"], {"name": self.lock_key(key)}).all())
        held = self._held_rows([row for row in rows if row[7]])
        return self._lock_info(held[0]) if held else None

    def health(self) -> tuple[float, bool, int]:
        """(round trip seconds, whether the lock tables exist, held lock rows) without creating anything."""

        def probe(conn: sa.Connection) -> tuple[float, bool, int]:
            started = time.perf_counter()
            present = bool(conn.execute(_SQL["tables_present"]).scalar_one())
            rtt = time.perf_counter() - started
            return rtt, present, int(conn.execute(_SQL["held_count"]).scalar_one()) if present else 0

        for attempt in (1, 2):
            try:
                with self.engine.connect() as conn:
                    return probe(conn)
            except sa.exc.DBAPIError as exc:
                if attempt == 1 and exc.connection_invalidated:
                    continue
                raise self._unreachable(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Nothing of its own: the engine is the process's (:func:`~celery_safe_time.coordination.dispose_engines`)."""


_SESSION_RENEW = _Call(QUERIES["session_renew"], "i")
_SESSION_RELEASE = _Call(QUERIES["session_release"], "bs")
_SESSION_COMMIT = _Call(QUERIES["session_commit"], "bbs")


#: How long a release waits for a renewal running on the session's connection. A renewal answers in
#: milliseconds; one still running after this hangs on a stalled path, and the release goes on
#: without the connection (the renewal closes it when its own deadline ends it).
_BUSY_SESSION_WAIT = 1.0


class _Session:
    """A held session lock's pooled DBAPI connection, used by one thread at a time: the renewing
    thread and the task's release would otherwise send on it at once (libpq refuses the second).

    ``claim`` waits for the connection and returns it, or None where the session has ended
    (released, or lost in a renewal, which closed it). ``give_back`` hands it on; the holder of a
    claim whose session was ended meanwhile (by a release that could not wait) closes the connection.
    """

    __slots__ = ("busy", "conn", "ended", "turn")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.turn = threading.Condition(threading.Lock())
        #: a thread has the connection
        self.busy = False
        #: released, lost or closed: nothing more runs on the connection
        self.ended = False

    def claim(self, timeout: float | None = None, *, last: bool = False) -> Any:
        """The connection, once no other thread has it (at most ``timeout`` seconds); None where the
        session has ended or the wait ran out. ``last``: the session ends with this claim (a release)."""
        with self.turn:
            free = self.turn.wait_for(lambda: not self.busy, timeout)
            gone = self.ended
            self.ended = self.ended or last
            if not free or gone:
                return None
            self.busy = True
            return self.conn

    def give_back(self, *, lost: bool = False) -> bool:
        """Hand the connection on; ``lost``: the session is gone. True when this call closed it."""
        with self.turn:
            self.busy = False
            self.turn.notify_all()
            self.ended = self.ended or lost
            close = self.ended
        return close


class PostgresSessionLockBackend(PostgresLockBackend):
    """Overlap locks as session advisory locks (``safe_time_coordination_locks = "session"``).

    The acquiring call checks a connection out of the pool and keeps it until the lock is released:
    the lock is that connection's session, and PostgreSQL drops it the moment the connection dies.
    Renewing checks that the connection is alive and the row is still ours; ``ttl`` plays no part.
    Markers and unique keys are rows, as in lease mode.
    """

    session = True

    def __init__(self, config: SafeTimeConfig, engine: sa.Engine | None = None) -> None:
        super().__init__(config, engine)
        #: The pooled DBAPI connection (its session holds the advisory lock) of each held (key, token).
        self._held: dict[tuple[str, str], _Session] = {}
        self._held_lock = threading.Lock()

    def _checkout(self) -> Any:
        try:
            return self._raw_checkout()
        except sa.exc.TimeoutError as exc:
            # Every pooled connection holds a lock of this process: as good as unreachable (re-queue).
            raise CoordinationUnavailable(
                f"{self.describe()}: no free connection for another session lock"
                f" ({C.COORDINATION_POOL_SIZE + C.COORDINATION_POOL_OVERFLOW} held by this process): {exc}"
            ) from exc

    def _acquire_lease(
        self, key: str, token: str, ttl: float, owner: Owner, marker: str | None, earlier_tokens: tuple[str, ...]
    ) -> Acquired:
        # Our own token already holds it on one of this process's sessions (a retried call): ask on
        # that session, where the advisory lock is ours and the row's token makes it a take-over.
        # An earlier attempt in another process whose reply was lost closed its session (see below),
        # so its lock is free and the row's token is taken over the same way.
        with self._held_lock:
            mine = next((t for t in (token, *earlier_tokens) if (key, t) in self._held), None)
            earlier = self._held.pop((key, mine)) if mine is not None else None
        if earlier is not None and earlier.claim() is None:  # a renewal found that session gone
            earlier = None
        session = _Session(self._checkout()) if earlier is None else earlier
        if earlier is None:
            session.claim()
        conn = session.conn
        try:
            acquired = self._in_session(
                conn, lambda c: self._acquire_on(c, key, token, ttl, owner, marker, earlier_tokens)
            )
        except BaseException:
            session.give_back(lost=True)  # _in_session closed it
            raise
        if acquired.status != "acquired":
            session.give_back(lost=True)
            if earlier is not None:
                conn.invalidate()  # it held the lock: closing the session frees it
            conn.close()
            return acquired
        session.give_back()
        with self._held_lock:
            self._held[(key, token)] = session
        return acquired

    def _in_session(self, conn: Any, work: Callable[[Any], T]) -> T:
        """``work(conn)``; on any error the session ends, and whatever advisory lock it holds with it."""
        unreachable = self._dbapi_errors()[1]
        try:
            return work(conn)
        except BaseException as exc:
            conn.invalidate()
            conn.close()
            if isinstance(exc, unreachable):
                raise self._unreachable(exc) from exc
            raise

    def renew(self, key: str, token: str, ttl: float) -> bool:
        with self._held_lock:
            session = self._held.get((key, token))
        if session is None:
            return False
        conn = session.claim()
        if conn is None:
            return False
        lost = True
        try:
            renewed = self._fetch(conn, _SESSION_RENEW, (self.lock_key(key), token)) is not None
            lost = False
        except self._dbapi_errors()[0] as exc:
            # The session is gone, and its advisory lock with it: lost, not merely unreachable.
            logger.warning("overlap lock %r: its PostgreSQL session ended: %s", key, exc)
            renewed = False
        finally:
            if session.give_back(lost=lost):  # lost here, or released meanwhile by a release that could not wait
                conn.invalidate()
                conn.close()
                renewed = False
        return renewed

    def _finish(self, key: str, token: str, work: Callable[[Any], T], fallback: Callable[[], T]) -> T:
        with self._held_lock:
            session = self._held.pop((key, token), None)
        if session is None:
            # Not held here (a hard-limit release from the worker's main process): the session that
            # held it has ended with its process; only the row is left to delete.
            return fallback()
        conn = session.claim(_BUSY_SESSION_WAIT, last=True)
        if conn is None:
            # A renewal found the session gone, or hangs on it (a stalled path): the row is released
            # on another connection, and the hung renewal ends the session once its deadline ends it.
            return fallback()
        try:
            result = self._in_session(conn, work)
            conn.close()
        finally:
            session.give_back()
        self._maybe_purge()
        return result

    def release(self, key: str, token: str, finished: tuple[str, float, str] | None = None) -> bool:
        params = self._release_params(key, token, finished)

        def work(conn: Any) -> bool:
            return bool(self._fetch(conn, _SESSION_RELEASE, params)[0])

        return self._finish(key, token, work, lambda: self._run_raw(work))

    def commit(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None = None
    ) -> tuple[bool, bool]:
        params = self._commit_params(lock, marker, token, window, task_id, finished)

        def work(conn: Any) -> tuple[bool, bool]:
            recorded, released, _ = self._fetch(conn, _SESSION_COMMIT, params)
            return bool(recorded), bool(released)

        return self._finish(lock, token, work, lambda: self._run_raw(work))

    def _held_rows(self, rows: list[Any]) -> list[Any]:
        """A row whose advisory lock no session holds is left from a holder that died: not held."""
        if not rows:
            return rows
        names = [row[0] for row in rows]
        held = set(self._run(lambda conn: conn.execute(_SQL["advisory_held"], {"names": names}).scalars().all()))
        return [row for row in rows if row[0] in held]

    def holder_record(self, key: str) -> HolderRecord | None:
        record = super().holder_record(key)
        if record is None or not self._held_rows([(self.lock_key(key),)]):
            return None
        return record

    def close(self) -> None:
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        for session in held:
            conn = session.claim(_BUSY_SESSION_WAIT, last=True)
            if conn is not None:  # else a renewal has it and closes it
                conn.invalidate()
                conn.close()
                session.give_back()


def postgres_lock_backend(config: SafeTimeConfig) -> PostgresLockBackend:
    """The PostgreSQL backend ``config`` asks for (``safe_time_coordination_locks``)."""
    postgres_url(config)  # a Django store that is not PostgreSQL fails here, naming the setting
    if config.coordination_locks == C.PG_LOCK_MODE_SESSION:
        return PostgresSessionLockBackend(config)
    return PostgresLockBackend(config)
