"""The SQLAlchemy Core store for PostgreSQL, SQLite and MySQL/MariaDB."""

from __future__ import annotations

import abc
import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from .... import constants as C
from ....clock import as_utc
from ....config import mask_url
from ....exceptions import StoreError
from ....sql.engine import create_engine
from .. import base
from ..base import DelayRow, DelayStore, InsertResult, NewDelay, StartResult
from .ddl import StoreSchema
from .postgres import RecordWrites
from .schema import (
    UTCDateTime,
    delays,
    mysql_pending_key,
    status_is,
)
from .statements import (
    Now,
    bind,
    dead,
    finish_update,
    hand_back_update,
    heartbeat_update,
    looked_away,
    older,
    stale_heartbeat,
    start_update,
    suspect,
)

logger = logging.getLogger(__name__)


class SQLStore(DelayStore):
    """The store as SQLAlchemy Core statements on the delay table, over the connections a subclass lends
    (:meth:`_begin`): :class:`SQLAlchemyStore`'s own engine, or Django's (the contrib app's store).

    Due rows are claimed with ``FOR UPDATE SKIP LOCKED`` where the database has it. The PostgreSQL fast
    paths (autocommit statements, :class:`RecordWrites`) run where the store owns its connections.
    """

    url: str
    engine: Engine
    dialect: str
    #: PostgreSQL, own pool: autocommit checkouts for one-statement writes (None: every write in ``_begin``).
    _autocommit: Engine | None = None
    #: PostgreSQL, own pool: the delivery record's per-task writes (see RecordWrites).
    _record_writes: RecordWrites | None = None
    #: MySQL/MariaDB: the pending key is the generated column of a table this store made (not Django's).
    _pending_key_column: bool = False

    @property
    def _is_mysql(self) -> bool:
        return self.dialect in C.MYSQL_DIALECTS

    def _fail(self, exc: Exception) -> StoreError:
        return StoreError(f"store {mask_url(self.url)}: {exc.__class__.__name__}: {exc}")

    def ensure_schema(self) -> None:
        """Nothing: the table is made elsewhere (:class:`SQLAlchemyStore` creates it on first use)."""

    @abc.abstractmethod
    def _begin(self) -> AbstractContextManager[Connection]:
        """One short transaction; database errors become :class:`StoreError`."""

    def ping(self) -> None:
        self.now()

    def _db_now(self, conn: Connection) -> datetime:
        """The database server's clock, read when the statement runs."""
        return as_utc(conn.execute(sa.text(base.NOW_SQL[self.dialect])).scalar_one())

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
        """A connection and "now" for the delivery record's writes where no :class:`RecordWrites` runs
        them (SQLite, MySQL/MariaDB; a start that lost, on PostgreSQL): ``clock_timestamp()`` inside
        the statement on PostgreSQL."""
        return self._one_statement(sa.func.clock_timestamp())

    @contextmanager
    def _one_statement(self, postgres_now: Now) -> Iterator[tuple[Connection, Now]]:
        """PostgreSQL: an autocommit connection, ``postgres_now`` evaluated by the server inside the
        statement (one conditional UPDATE is atomic on its own). Elsewhere: one short transaction that
        reads the database's clock first, like every other write here."""
        autocommit = self._autocommit
        if autocommit is None:
            with self._begin() as conn:
                yield conn, self._db_now(conn)
            return
        self.ensure_schema()
        try:
            with autocommit.connect() as conn:
                yield conn, postgres_now
        except sa.exc.SQLAlchemyError as exc:
            raise self._fail(exc) from exc

    def _record_write(
        self,
        writes: RecordWrites,
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
        """Rows of this store's namespace and the shared one (every row for a store without one)."""
        scope = self.scope
        return sa.true() if scope is None else delays.c.namespace.in_(scope)

    # --- writes --------------------------------------------------------------------

    def insert(self, delay: NewDelay) -> InsertResult:
        # Fast path, one short transaction: [key lookup,] now, INSERT. A unique violation (the task
        # id is taken, or a concurrent call won the idempotency key) takes the careful path.
        try:
            with self._begin() as conn:
                return self._insert_on(conn, delay, careful=False)
        except StoreError as exc:
            if not isinstance(exc.__cause__, sa.exc.IntegrityError):
                raise
        with self._begin() as conn:
            return self._insert_on(conn, delay, careful=True)

    def _insert_on(
        self, conn: Connection, delay: NewDelay, *, careful: bool, now: datetime | None = None, held: bool = True
    ) -> InsertResult:
        """``held=False``: the key was just looked up; a row that holds it since is a unique violation."""
        t = delays
        if held and delay.idempotency_key is not None:
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

    def debounce(self, delay: NewDelay) -> InsertResult:
        if self._autocommit is not None and delay.due_at is None:
            # Most calls of a burst find their row: one autocommit UPDATE moves it (one round trip).
            moved = self._debounce_in_place(delay)
            if moved is not None:
                return moved
        # Two first calls of a burst both find no pending row and both insert: the loser's unique
        # violation (or a deadlock on MySQL/MariaDB) runs its transaction again, and it then finds the
        # winner's row to move. From the second attempt the insert checks the task id first.
        for attempt in range(C.DEBOUNCE_ATTEMPTS):
            try:
                with self._begin() as conn:
                    return self._debounce_on(conn, delay, careful=attempt > 0)
            except StoreError as exc:
                if attempt == C.DEBOUNCE_ATTEMPTS - 1 or not _retryable(exc.__cause__):
                    raise
                logger.debug("debounce %r met a concurrent call (%s); again", delay.idempotency_key, exc.__cause__)
        raise AssertionError("unreachable")  # pragma: no cover

    def _debounce_in_place(self, delay: NewDelay) -> InsertResult | None:
        """PostgreSQL: move the pending row of the key in one statement, the server's clock inside it;
        None when no pending row holds the key. The UPDATE waits for a claim that holds the row and
        then reads it again: claimed by then, it matches no more (None: a new burst)."""
        t = delays
        key = delay.idempotency_key
        if key is None or delay.countdown is None:
            return None
        with self._one_statement(sa.func.clock_timestamp()) as (conn, now):
            due = now + sa.literal(timedelta(seconds=delay.countdown), sa.Interval())
            capped = sa.case(
                (sa.and_(t.c.debounce_until.is_not(None), t.c.debounce_until < due), t.c.debounce_until), else_=due
            )
            expires: Any = delay.expires_at
            if expires is None and delay.expires_in is not None:
                expires = now + sa.literal(timedelta(seconds=delay.expires_in), sa.Interval())
            found = conn.execute(
                sa.update(t)
                .where(self._pending_key_is(key), self._in_scope())
                .values(
                    payload=delay.payload,
                    content_type=delay.content_type,
                    content_encoding=delay.content_encoding,
                    due_at=capped,
                    expires_at=expires,
                    delivery_token=base.new_delivery_token(),
                    updated_at=now,
                )
                .returning(t.c.id, t.c.due_at)
            ).first()
        return None if found is None else InsertResult(found.id, created=False, due_at=as_utc(found.due_at))

    def _debounce_on(self, conn: Connection, delay: NewDelay, *, careful: bool) -> InsertResult:
        t = delays
        key = delay.idempotency_key
        if key is None:
            raise StoreError("a debounced delay needs its key in idempotency_key")
        now = self._db_now(conn)
        # The key finds the row, unlocked; then the row is locked by its primary key alone, as the
        # sweep's claim locks it. Locked through the key's index instead, a claim that already holds
        # the row (and must update that index entry) and this call would wait for each other (an
        # InnoDB deadlock). FOR UPDATE waits for a claim (one short statement) and reads the row again
        # once it commits: claimed by then, it is pending no more, and this call starts a new burst.
        # While this transaction holds the row, the claim's SKIP LOCKED passes it by.
        pending = conn.execute(sa.select(t.c.id).where(self._pending_key_is(key), self._in_scope())).scalar()
        found = None
        if pending is not None:
            found = conn.execute(
                sa.select(t.c.id, t.c.debounce_until)
                .where(t.c.id == pending, status_is(C.STATUS_PENDING))
                .with_for_update()
            ).first()
        if found is not None:
            until = None if found.debounce_until is None else as_utc(found.debounce_until)
            values = base.debounced_values(delay, now, until)
            moved = conn.execute(
                sa.update(t).where(t.c.id == found.id, status_is(C.STATUS_PENDING)).values(**values)
            ).rowcount
            if moved:
                return InsertResult(found.id, created=False, due_at=values["due_at"])
            # SQLite has no FOR UPDATE and reads outside the write transaction: a claim between the
            # read and this UPDATE left nothing to move, so the call starts a new burst.
        # A first call that won the key meanwhile makes this INSERT a unique violation, and the next
        # attempt merges into its row (never returns it unmerged).
        return self._insert_on(conn, delay, careful=careful, now=now, held=False)

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
                    raise base.refused(index, str(exc)) from exc
            return results

    def _insert_many_fast(self, conn: Connection, batch: Sequence[NewDelay]) -> list[InsertResult]:
        t = delays
        held: dict[str, tuple[str, datetime]] = {}
        keys = sorted({d.idempotency_key for d in batch if d.idempotency_key is not None})
        key_column = mysql_pending_key if self._pending_key_column else t.c.idempotency_key
        for start in range(0, len(keys), C.BULK_KEY_LOOKUP):
            chunk = keys[start : start + C.BULK_KEY_LOOKUP]
            query = sa.select(key_column, t.c.id, t.c.due_at).where(key_column.in_(chunk), self._in_scope())
            if not self._pending_key_column:
                query = query.where(status_is(C.STATUS_PENDING))
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
        if self._pending_key_column:
            return mysql_pending_key == key
        return sa.and_(delays.c.idempotency_key == key, status_is(C.STATUS_PENDING))

    def bulk_insert(self, rows: Sequence[NewDelay], *, chunk: int = 5000) -> None:
        """Insert many pending rows fast (benchmarks and tests); no idempotency handling."""
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            for start in range(0, len(rows), chunk):
                conn.execute(sa.insert(t), [self.new_row(d, now) for d in rows[start : start + chunk]])

    def _update_now(self, build: Callable[[datetime], sa.Update]) -> int:
        """Rows changed by the UPDATE ``build(now)`` (``now``: the database's), in one transaction."""
        with self._begin() as conn:
            return int(conn.execute(build(self._db_now(conn))).rowcount)

    def _update_one(self, task_id: str, statuses: frozenset[str], values: Callable[[datetime], dict[str, Any]]) -> bool:
        """Set ``values(now)`` (and ``updated_at``) on row ``task_id`` of this namespace if it is in one of
        ``statuses``; True when it changed."""
        where = (delays.c.id == task_id, delays.c.status.in_(sorted(statuses)), self._in_scope())
        return bool(self._update_now(lambda now: sa.update(delays).where(*where).values(**values(now), updated_at=now)))

    def cancel(self, task_id: str) -> bool:
        cancelled = {"status": C.STATUS_CANCELLED, "claim_token": None}
        return self._update_one(task_id, C.DELAY_CANCELLABLE_STATUSES, lambda now: cancelled)

    def reschedule(self, task_id: str, due_at: datetime) -> bool:
        def values(now: datetime) -> dict[str, Any]:
            token = base.new_delivery_token()
            return {"due_at": due_at, "status": C.STATUS_PENDING, "claim_token": None, "delivery_token": token}

        return self._update_one(task_id, C.DELAY_CANCELLABLE_STATUSES, values)

    def rerun(self, task_id: str) -> bool:
        return self._update_one(task_id, C.DELAY_RERUNNABLE_STATUSES, base.rerun_values)

    # --- the delivery record ---------------------------------------------------------

    def _start(
        self, task_id: str, token: str, run_id: str, worker: str, stale: float, prior: Sequence[str], leeway: float
    ) -> StartResult:
        t = delays
        worker = worker[: C.DELIVERY_WORKER_LENGTH]
        writes = self._record_writes
        if writes is not None:
            # This run's own id is among the run ids it may take over: a start sent again after its
            # reply was lost (RecordWrites) wins again, and counts once.
            params = {
                "task_id": task_id,
                "token": token,
                "run_id": run_id,
                "worker": worker,
                "takeover": [*prior, run_id],
            }

            def build() -> sa.Update:
                own = bind("run_id")
                return start_update(
                    bind("task_id"),
                    bind("token"),
                    own,
                    bind("worker"),
                    sa.func.clock_timestamp(),
                    stale,
                    takeover=t.c.started_by == sa.any_(bind("takeover", postgresql.ARRAY(sa.String))),
                    starts=sa.case((t.c.started_by == own, t.c.starts), else_=t.c.starts + 1),
                    leeway=leeway,
                )

            if self._record_write(writes, ("start", stale, leeway), build, params, durable=True) == 1:
                return StartResult("run")
            with self._statement_clock() as (conn, now):
                return self._lost_start(conn, now, task_id, token, stale, leeway)
        with self._statement_clock() as (conn, now):
            takeover = t.c.started_by.in_(list(prior)) if prior else None
            started = start_update(task_id, token, run_id, worker, now, stale, takeover, t.c.starts + 1, leeway=leeway)
            if conn.execute(started).rowcount == 1:
                return StartResult("run")
            return self._lost_start(conn, now, task_id, token, stale, leeway)

    def _lost_start(
        self, conn: Connection, now: Now, task_id: str, token: str, stale_after: float, leeway: float = math.inf
    ) -> StartResult:
        """Why a start did not win; a stale heartbeat seen here for the first time becomes a suspicion."""
        t = delays
        conn.execute(
            sa.update(t)
            .where(t.c.id == task_id, t.c.delivery_token == token, suspect(now, stale_after))
            .values(suspected_at=now)
        )
        mapping = conn.execute(sa.select(t).where(t.c.id == task_id)).mappings().first()
        row = None if mapping is None else DelayRow.from_mapping(mapping)
        early = 0.0
        if math.isfinite(leeway) and row is not None and row.status in C.DELAY_STARTABLE_STATUSES:
            early = base.early_by(row, now if isinstance(now, datetime) else self._db_now(conn), leeway)
        return StartResult(base.start_verdict(row, token, early), row, early)

    def _write_run(
        self,
        name: str,
        update: Callable[..., sa.Update],
        task_id: str,
        token: str,
        run_id: str,
        *,
        durable: bool = True,
        **values: Any,
    ) -> bool:
        """Run ``update`` (a heartbeat or an end of run ``run_id``) with ``values``; a None value leaves its
        column as it is. PostgreSQL: compiled once, sent on :class:`RecordWrites`' pools."""
        writes = self._record_writes
        if writes is None:
            with self._statement_clock() as (conn, now):
                return bool(conn.execute(update(task_id, token, run_id, now, **values)).rowcount)
        given = {key: value for key, value in values.items() if value is not None}

        def build() -> sa.Update:
            binds = {key: None if value is None else bind(key) for key, value in values.items()}
            return update(bind("task_id"), bind("token"), bind("run_id"), sa.func.clock_timestamp(), **binds)

        params = {"task_id": task_id, "token": token, "run_id": run_id, **given}
        return bool(self._record_write(writes, (name, *sorted(given)), build, params, durable=durable))

    def heartbeat(self, task_id: str, token: str, run_id: str) -> bool:
        # Not flushed: a heartbeat a crash forgets is followed by the next one, lock_ttl / 3 later.
        return self._write_run("heartbeat", heartbeat_update, task_id, token, run_id, durable=False)

    def finish(
        self, task_id: str, token: str, run_id: str, outcome: str, error: str | None = None, *, durable: bool = True
    ) -> bool:
        last_error = None if error is None else base.truncate_error(error)
        return self._write_run(
            "finish", finish_update, task_id, token, run_id, outcome=outcome, last_error=last_error, durable=durable
        )

    def hand_back(self, task_id: str, token: str, run_id: str) -> bool:
        return self._write_run("hand_back", hand_back_update, task_id, token, run_id)

    def requeue_unstarted(self, grace: float) -> int:
        t = delays

        def build(now: datetime) -> sa.Update:
            # One bound per number of claims (the doublings are few), so every dialect compares plain
            # timestamps.
            def sent_before(attempts: int) -> sa.ColumnElement[bool]:
                return t.c.sent_at < now - timedelta(seconds=base.republish_after(grace, attempts))

            last = base.REPUBLISH_DOUBLINGS + 1
            waited = sa.or_(
                sa.and_(t.c.attempts <= 1, sent_before(1)),
                *(sa.and_(t.c.attempts == n, sent_before(n)) for n in range(2, last)),
                sa.and_(t.c.attempts >= last, sent_before(last)),
            )
            cutoff = now - timedelta(seconds=grace)
            return (
                sa.update(t)
                .where(status_is(C.STATUS_SENT), waited, t.c.due_at < cutoff, self._in_scope())
                .values(status=C.STATUS_PENDING, updated_at=now)
            )

        return self._update_now(build)

    def expired_unstarted(self, limit: int) -> list[DelayRow]:
        t = delays
        # One round trip per sweep on PostgreSQL. The sent rows are few (published, not started yet):
        # the partial index on them holds them.
        with self._sweep_clock() as (conn, now):
            query = (
                sa.select(t)
                .where(status_is(C.STATUS_SENT), t.c.expires_at < now, self._in_scope())
                .order_by(t.c.expires_at, t.c.id)
                .limit(limit)
            )
            return [DelayRow.from_mapping(m) for m in conn.execute(query).mappings()]

    def end_expired(self, task_id: str, token: str) -> bool:
        t = delays
        with self._sweep_clock() as (conn, now):
            result = conn.execute(
                sa.update(t)
                .where(
                    t.c.id == task_id,
                    status_is(C.STATUS_SENT),
                    t.c.delivery_token == token,
                    t.c.expires_at < now,
                    self._in_scope(),
                )
                .values(status=C.STATUS_EXPIRED, updated_at=now)
            )
            return bool(result.rowcount)

    def stale_started(self, stale_after: float, limit: int) -> list[DelayRow]:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            query = (
                sa.select(t)
                .where(status_is(C.STATUS_STARTED), stale_heartbeat(now, stale_after), self._in_scope())
                .order_by(t.c.heartbeat_at, t.c.id)
                .limit(limit)
            )
            return [DelayRow.from_mapping(m) for m in conn.execute(query).mappings()]

    def end_stale(
        self, task_id: str, token: str, stale_after: float, *, rerun: bool, looked_within: float = math.inf
    ) -> bool:
        t = delays
        with self._begin() as conn:
            now = self._db_now(conn)
            values: dict[str, Any] = (
                {"status": C.STATUS_PENDING, "suspected_at": None}
                if rerun
                else {"status": C.STATUS_FINISHED, "outcome": C.OUTCOME_INTERRUPTED, "finished_at": now}
            )
            mine = sa.and_(t.c.id == task_id, t.c.delivery_token == token)
            gone = sa.and_(dead(now, stale_after), sa.not_(looked_away(now, looked_within)))
            result = conn.execute(sa.update(t).where(mine, gone).values(updated_at=now, **values))
            if result.rowcount:
                return True
            restart = sa.or_(suspect(now, stale_after), looked_away(now, looked_within))
            if conn.execute(sa.update(t).where(mine, restart).values(suspected_at=now, updated_at=now)).rowcount:
                return False
            # Still suspected: this look is recorded (updated_at), so the next one knows the store answered.
            looked = sa.and_(status_is(C.STATUS_STARTED), t.c.suspected_at.is_not(None))
            conn.execute(sa.update(t).where(mine, looked).values(updated_at=now))
            return False

    # --- the sweep -------------------------------------------------------------------

    def _due(
        self, column: sa.ColumnElement[Any], horizon: datetime | sa.ColumnElement[Any], limit: int
    ) -> sa.Select[Any]:
        """``column`` of the pending rows due by ``horizon``, the first ``limit`` in due order (the claim's index)."""
        t = delays
        where = (status_is(C.STATUS_PENDING), t.c.due_at <= horizon, self._in_scope())
        return sa.select(column).where(*where).order_by(t.c.due_at, t.c.id).limit(limit)

    def claim_query(self, *, limit: int, horizon: datetime | sa.ColumnElement[Any]) -> sa.Select[Any]:
        """The ``SELECT ... FOR UPDATE SKIP LOCKED`` that picks due rows (also used by EXPLAIN)."""
        query = self._due(delays.c.id, horizon, limit)
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
                    sa.update(t).where(t.c.id == cte.c.id, status_is(C.STATUS_PENDING)).values(**values).returning(*t.c)
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
        # The claim's index, read up to ``limit`` entries: the count costs no more than that many rows.
        picked = self._due(delays.c.due_at, horizon, limit).subquery()
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
                .where(t.c.id.in_(list(task_ids)), status_is(C.STATUS_CLAIMED), t.c.claim_token == token)
                .values(claim_token=None, status=status, **values)
            )
            return int(result.rowcount)

    def reclaim_stale(self, timeout: float) -> int:
        t = delays
        return self._update_now(
            lambda now: (
                sa.update(t)
                .where(status_is(C.STATUS_CLAIMED), t.c.claimed_at < now - timedelta(seconds=timeout), self._in_scope())
                .values(status=C.STATUS_PENDING, claim_token=None, updated_at=now)
            )
        )

    # --- retention ---------------------------------------------------------------------

    def _purgeable(self, before: datetime, statuses: frozenset[str]) -> int:
        query = sa.select(sa.func.count()).select_from(delays).where(older(before, statuses), self._in_scope())
        with self._begin() as conn:
            return int(conn.execute(query).scalar_one())

    def _purge(self, before: datetime, statuses: frozenset[str], limit: int) -> int:
        t = delays
        old = sa.and_(older(before, statuses), self._in_scope())
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

    def _list(self, status: str | None, task: str | None, due_before: datetime | None, limit: int) -> list[DelayRow]:
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
        counts = base.empty_counts()
        with self._begin() as conn:
            for status, count in conn.execute(
                sa.select(delays.c.status, sa.func.count()).where(self._in_scope()).group_by(delays.c.status)
            ).all():
                counts[status] = int(count)
        return counts

    def pending_debounced(self) -> int:
        query = sa.select(sa.func.count()).where(
            status_is(C.STATUS_PENDING),
            delays.c.idempotency_key.like(C.DEBOUNCE_KEY_PREFIX + "%"),
            self._in_scope(),
        )
        with self._begin() as conn:
            return int(conn.execute(query).scalar() or 0)

    def oldest_due(self, status: str = C.STATUS_PENDING) -> datetime | None:
        with self._begin() as conn:
            query = sa.select(sa.func.min(delays.c.due_at)).where(status_is(status), self._in_scope())
            value = conn.execute(query).scalar()
        # min() loses the column type on some dialects: normalise here.
        return None if value is None else as_utc(value)


class SQLAlchemyStore(StoreSchema, SQLStore):
    """Delayed tasks in a SQL table on an engine of its own (PostgreSQL, SQLite, MySQL/MariaDB).

    The table is created on first use (``CREATE TABLE``/``CREATE INDEX`` if missing); Django
    projects get the same table from the contrib app's migrations instead.
    """

    def __init__(self, url: str, *, engine: Engine | None = None, timeout: float | None = None) -> None:
        self.url = url
        self.engine = engine if engine is not None else create_engine(url, timeout=timeout)
        self.dialect = self.engine.dialect.name
        self._pending_key_column = self._is_mysql
        # A server database's pool is thread-safe: the sweep claims its next batch in a thread. Not
        # SQLite's (one writer, and an in-memory database is one per thread's connection).
        self.claims_in_background = self.dialect != "sqlite"
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        if self.dialect == "postgresql":
            #: Same pool; each checkout in autocommit (reset when it goes back to the pool).
            self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self._record_writes = RecordWrites(self.engine.url.render_as_string(hide_password=False), timeout)

    def now(self) -> datetime:
        try:
            with self.engine.connect() as conn:
                # SQLStore's clock, not a subclass's: the testing kit's moves its own on from this one.
                return SQLStore._db_now(self, conn)
        except sa.exc.SQLAlchemyError as exc:
            # the engine's URL names the driver it connects with (postgresql+psycopg)
            where = mask_url(str(self.engine.url))
            raise StoreError(f"store {where} unreachable: {exc.__class__.__name__}: {exc}") from exc

    def close(self) -> None:
        self.engine.dispose()
        if self._record_writes is not None:
            self._record_writes.dispose()

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        self.ensure_schema()
        try:
            with self.engine.begin() as conn:
                yield conn
        except sa.exc.SQLAlchemyError as exc:
            raise self._fail(exc) from exc


def _retryable(error: BaseException | None) -> bool:
    """A unique violation (a concurrent first call won the key) or a deadlock: run the transaction again."""
    if isinstance(error, sa.exc.IntegrityError):
        return True
    if isinstance(error, sa.exc.DBAPIError):
        # PostgreSQL's SQLSTATE 40P01 / 40001, MySQL/MariaDB's 1213 (deadlock) and 1205 (lock wait).
        code = getattr(error.orig, "sqlstate", None) or (getattr(error.orig, "args", None) or (None,))[0]
        return code in {"40P01", "40001", 1213, 1205}
    return False
