"""The PostgreSQL beat backend (``safe_time_coordination_url``): the lease, fired slots and schedule
state as rows of the coordination database, its clock the authority.

Three tables, created by the first beat that needs them (``CREATE TABLE IF NOT EXISTS`` under a
transaction-level advisory lock, so beats starting together do not race); every row carries ``ns``,
the app's ``safe_time_key_prefix``, so apps sharing a database never see each other's rows:

- ``safe_time_beat_lease`` (``ns`` primary key): the holder's ``token``, ``epoch`` (bumped by every
  new holder, never reset: a release empties the token and keeps the row), ``expires_at`` on the
  database clock (``clock_timestamp()``) and the holder's ``info`` (host, pid, since).
- ``safe_time_beat_fired`` (primary key ``ns, entry, slot_ms``): one row per published slot; the
  unique key is the guard (``INSERT ... ON CONFLICT DO NOTHING``). The leader deletes rows older
  than ``FIRED_SLOT_TTL`` every ``BEAT_PRUNE_INTERVAL`` (Redis markers expire by themselves).
- ``safe_time_beat_state`` (primary key ``ns, entry``): each entry's state JSON and its next fire
  time (``next_fire``, NULL when the entry is not scheduled: paused, broken); a partial index on
  ``next_fire`` is the due set. ``safe_time_beat_counts`` holds its row counts per ``ns`` (all, and
  scheduled), kept by statement-level triggers on it, so a tick reads two numbers instead of counting.

Acquire, renew and release are one conditional statement each. A tick's dispatches are one statement
too: the lease check (``FOR SHARE`` on the lease row, so a standby's take-over waits for it), the
fired-slot inserts and the state upserts, atomic together: no slot is published by a beat whose
lease expired, none twice. No session state is used (no advisory session locks, no prepared
statements kept, no temporary tables, no ``SET``): the backend works behind PgBouncer in
transaction mode. Each beat process holds the connections of one pooled engine
(:func:`celery_safe_time.coordination.coordination_engine`): in practice two, the lease thread's
and the tick's.

Runtime entries (``save_entry``, ``celery safe-time beat ...``) live in four more tables:
``safe_time_beat_entries`` (definitions), ``safe_time_beat_changes`` (the change log: each name's
version of its last change, kept as a tombstone after a delete until the leader applied it),
``safe_time_beat_meta`` (the change counter and the leader's applied marker) and
``safe_time_beat_run_now``; ``safe_time_beat_entry_counts`` holds the definitions' count, kept by
triggers as the state's. A writer holds the counter row for its transaction, so versions commit
in order; the leader reads the counter with every tick's due read and, when it moved, only the
changed names. With many runtime entries a leader reads only what is due (:mod:`.postgres_reads`).

Sharded firing (``safe_time_beat_shards`` above 1, :mod:`..shards`): each shard's own rows (its
lease row, state rows and their counts, applied marker, pause expiries) carry the shard's namespace
as ``ns`` (:func:`.postgres_reads.shard_ns`: shard 0's is the app's, so one leader's rows are shard
0's), so each shard has its own epoch and its own due index range; the definitions, the change log,
the fired slots and the history stay under the app's ``ns``, shared, so a slot is published at most
once whichever beat leads its shard, also across a move. ``safe_time_beat_beats`` holds each beat's
heartbeat (how many shards it holds). The SQL is in ``beat/sql/`` (:mod:`.postgres_reads`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa

from ... import constants as C
from ...clock import ServerClock, Sync, measure_sync
from ...config import SafeTimeConfig, mask_url
from ...coordination import coordination_engine, postgres_url
from ...exceptions import ImproperlyConfigured
from ..shards import BeatPulse, shard_of
from ..state import marker_value, slot_id, with_definitions
from .base import UNFIRED_STATE_PREFIX, BeatLease, DueRead, LeaseView, Scored, Seed, SlotWrite, Snapshot
from .postgres_reads import _QUERIES, DDL, PostgresReads, shard_ns

__all__ = ["DDL", "PostgresBeatBackend", "PostgresClock", "PostgresLease", "asked_again_if_broken"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_TABLE = "safe_time_beat_lease"
FIRED_TABLE = "safe_time_beat_fired"
STATE_TABLE = "safe_time_beat_state"
META_TABLE = "safe_time_beat_meta"
ENTRIES_TABLE = "safe_time_beat_entries"
CHANGES_TABLE = "safe_time_beat_changes"
RUN_NOW_TABLE = "safe_time_beat_run_now"
COUNTS_TABLE = "safe_time_beat_counts"
HISTORY_TABLE = "safe_time_beat_history"
AUDIT_TABLE = "safe_time_beat_audit"
PAUSE_EXPIRY_TABLE = "safe_time_beat_pause_expiry"
ENTRY_COUNTS_TABLE = "safe_time_beat_entry_counts"
DELETED_TABLE = "safe_time_beat_deleted"
BEATS_TABLE = "safe_time_beat_beats"


def asked_again_if_broken(connect: Callable[[], Any], run: Callable[[Any], T], level: int, message: str) -> T:
    """``run`` on a connection from ``connect``; when that connection turns out broken (the database
    restarted, a pooled connection died), log ``message`` (%s: the driver's error) and run it once
    more on a new one. Only for statements that are safe to ask twice."""
    try:
        with connect() as conn:
            return run(conn)
    except sa.exc.DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        logger.log(level, message, exc.orig)
    with connect() as conn:
        return run(conn)


class PostgresClock(ServerClock):
    """The coordination database's ``clock_timestamp()`` as the shared clock (see :class:`ServerClock`)."""

    unavailable: tuple[type[Exception], ...] = (sa.exc.SQLAlchemyError,)
    authority = "PostgreSQL clock_timestamp()"

    def __init__(self, backend: PostgresBeatBackend, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._backend = backend

    def measure(self) -> Sync:
        # one connection for the samples: a pool checkout (and its ping) must not count in the RTT
        with self._backend.engine().connect() as conn:
            return measure_sync(
                lambda: float(conn.execute(_QUERIES["now"]).scalar_one()), local=self._local, monotonic=self._monotonic
            )


class PostgresLease(BeatLease):
    def __init__(self, backend: PostgresBeatBackend, *, info: dict[str, Any] | None = None) -> None:
        super().__init__(backend.config, info)
        self.backend = backend
        self.ttl = float(backend.config.beat_lease)

    def _params(self, **extra: Any) -> dict[str, Any]:
        return self.backend._p(token=self.token, **extra)

    def acquire(self, now: float) -> int | None:
        self.backend.ensure_tables()
        info = json.dumps(self.holder_info(now))
        with self.backend.autocommit() as conn:
            self.sent_at = time.monotonic()
            epoch = conn.execute(_QUERIES["acquire"], self._params(ttl=self.ttl, info=info)).scalar_one_or_none()
        self.epoch = int(epoch) if epoch is not None else None
        return self.epoch

    def renew(self) -> bool:
        if self.epoch is None:
            return False
        with self.backend.autocommit() as conn:
            ok = bool(conn.execute(_QUERIES["renew"], self._params(ttl=self.ttl, epoch=self.epoch)).rowcount == 1)
        if not ok:
            self.epoch = None
        return ok

    def release(self) -> bool:
        self.epoch = None
        with self.backend.autocommit() as conn:
            return bool(conn.execute(_QUERIES["release"], self._params()).rowcount == 1)

    def _guarded(self, statement: sa.TextClause, params: dict[str, Any]) -> tuple[Any, ...]:
        """Run a guarded dispatch statement, once more on a new connection (same marker) when the
        connection is lost during it. The lost reply may be of a statement that committed (its slots
        marked fired by this call, not published yet) or of one that never reached the server: the
        retry's ``mine`` tells them apart, so the slot is published once either way (stepping down
        would miss it: its row says "fired")."""
        return asked_again_if_broken(
            self.backend.autocommit,
            lambda conn: tuple(conn.execute(statement, params).one()),
            logging.WARNING,
            "beat: the PostgreSQL connection broke during a dispatch (%s); asking again",
        )

    def write_slots(self, epoch: int, writes: list[SlotWrite]) -> list[int]:
        if not writes:
            return []
        params = self._params(
            epoch=epoch,
            entries=[w.entry for w in writes],
            slots=[None if w.slot is None else int(slot_id(w.slot)) for w in writes],
            states=[w.state for w in writes],
            nexts=[w.next_fire for w in writes],
            histories=[w.history for w in writes],
            history_size=self.config.beat_history_size,
            marker=marker_value(epoch),
        )
        leader, mine, fresh = self._guarded(_QUERIES["write_slots"], params)
        # rows of our own (an earlier attempt of this call committed, under the lease then): its
        # verdicts stand even if the lease is gone now
        if not leader and not mine:
            return [-1] * len(writes)
        # each fresh (entry, slot) answers 1 once: a slot written twice in one batch is fired once
        unclaimed = Counter((str(entry), int(slot_ms)) for entry, slot_ms in (fresh or []))
        verdicts = []
        for write in writes:
            if write.slot is None:
                verdicts.append(1)
                continue
            key = (write.entry, int(slot_id(write.slot)))
            if unclaimed[key] > 0:
                unclaimed[key] -= 1
                verdicts.append(1)
            else:
                verdicts.append(0)
        return verdicts

    def dispatch_slot(self, epoch: int, entry: str, slot: float) -> int:
        self.backend.ensure_tables()
        params = self._params(epoch=epoch, entry=entry, slot_ms=int(slot_id(slot)), marker=marker_value(epoch))
        leader, mine, fresh = self._guarded(_QUERIES["dispatch_slot"], params)
        if mine:
            return 1
        if not leader:
            return -1
        return 1 if fresh else 0

    def forget(self, epoch: int, names: list[str], *, keep_state: bool) -> bool:
        if not names:
            return True
        query = _QUERIES["forget"]
        leader, _ = self.backend._one(query, token=self.token, epoch=epoch, names=list(names), keep=keep_state)
        return bool(leader)


class PostgresBeatBackend(PostgresReads):
    name = C.COORDINATION_POSTGRES
    label = "PostgreSQL"
    keeps_heartbeats = True
    seeds_apart = True
    errors: tuple[type[Exception], ...] = (sa.exc.SQLAlchemyError,)

    def __init__(self, config: SafeTimeConfig, shard: int = 0) -> None:
        super().__init__(config, shard)
        self.clock = PostgresClock(self)
        self.due_name = "safe_time_beat_state (next_fire)" if shard == 0 else f"safe_time_beat_state (shard {shard})"
        self.state_name = STATE_TABLE

    # --- shards -----------------------------------------------------------------------
    def for_shard(self, shard: int) -> PostgresBeatBackend:
        backend = PostgresBeatBackend(self.config, shard)
        backend.clock = self.clock
        backend._tables_ready = self._tables_ready
        return backend

    def beats_heartbeat(self, member: str, pulse: BeatPulse, window: float) -> dict[str, BeatPulse]:
        self.ensure_tables()
        query = _QUERIES["beats_heartbeat"]
        rows = self._all(query, member=member, now=pulse.seen, pulse=pulse.dump(), window=window)
        return self._pulses((str(m), str(raw)) for m, raw in rows)

    def beats_seen(self) -> dict[str, BeatPulse]:
        self.ensure_tables()
        return self._pulses((str(member), str(raw)) for member, raw in self._all(_QUERIES["beats_seen"]))

    def beats_gone(self, member: str) -> None:
        self._exec(_QUERIES["beats_gone"], member=member)

    def _shard_ns_of(self, name: str) -> str:
        """The ``ns`` of the shard ``name`` belongs to (the API side reads and seeds any entry's state)."""
        return shard_ns(self.config, shard_of(name, self.config.beat_shards))

    # --- the lease ------------------------------------------------------------------
    def make_lease(self, *, info: dict[str, Any] | None = None) -> PostgresLease:
        return PostgresLease(self, info=info)

    def lease_view(self) -> LeaseView:
        self.ensure_tables()
        token, epoch, info, ttl_ms, now = self._one(_QUERIES["lease_view"])
        held = token is not None and ttl_ms is not None
        holder: dict[str, Any] = {}
        if held and info:
            with contextlib.suppress(ValueError):
                holder = {**json.loads(info), "epoch": int(epoch)}
        return LeaseView(
            info=holder,
            ttl_ms=int(ttl_ms) if held else None,
            epoch=int(epoch) if epoch is not None else None,
            now=float(now),
        )

    def holds_lease(self, token: str) -> bool:
        return bool(self._all(_QUERIES["holds_lease"], token=token))

    # --- connection ---------------------------------------------------------------
    def where(self) -> str:
        url = self.config.coordination_url
        return f"postgresql {'(the Django store)' if url == C.DJANGO_STORE else mask_url(url)}"

    def startup_checks(self, who: str) -> None:
        """Fail loudly when the database is unreachable; create the tables; report the clock offset."""
        try:
            self.ensure_tables()
            offset = self.clock.sync()
        except sa.exc.SQLAlchemyError as exc:
            raise ImproperlyConfigured(
                "safe_time_coordination_url",
                f"{who}: PostgreSQL {mask_url(postgres_url(self.config))} is unreachable at startup: {exc}",
            ) from exc
        if abs(offset.offset) > self.config.max_clock_skew:
            logger.warning(
                "%s: this host's clock is %+.3f s off the database's; beat uses the database clock, "
                "so it still fires on time",
                who,
                offset.offset,
            )

    # --- ticks --------------------------------------------------------------------
    def _read(self, statement: sa.TextClause, params: dict[str, Any]) -> Sequence[Any]:
        """A read on the engine without a pre-ping (an idle tick is this one statement, a pre-ping would
        double its round trips): a pooled connection found broken (the database restarted) is replaced,
        with the rest of the pool, and the read asked again once (it repeats safely), so the tick does
        not step down."""
        return asked_again_if_broken(
            coordination_engine(self.config, autocommit=True).connect,
            lambda conn: conn.execute(statement, params).all(),
            logging.INFO,
            "beat: a pooled PostgreSQL connection was broken (%s); reading again",
        )

    def read_due(self, now: float, limit: int) -> DueRead:
        rows = self._read(_QUERIES["read_due"], self._p(now=now, limit=limit))
        due: Scored = []
        head: Scored = []
        counts = {2: 0, 3: 0, 4: 0}
        for entry, value, kind in rows:
            if kind == 0:
                due.append((entry, float(value)))
            elif kind == 1:
                head.append((entry, float(value)))
            elif value is not None:
                counts[int(kind)] = int(value)
        return DueRead(due=due, due_count=counts[2], state_count=counts[3], version=counts[4], head=head)

    def head(self, limit: int = 1) -> Scored:
        rows = self._read(_QUERIES["head"], self._p(limit=limit))
        return [(entry, float(value)) for entry, value in rows]

    def drop_due(self, name: str) -> None:
        self._exec(_QUERIES["drop_due"], entry=name)

    # --- re-planning --------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return self._snapshot(definitions=True)

    def read_all(self) -> tuple[dict[str, Any], dict[str, float], int]:
        with self.autocommit() as conn:
            rows = conn.execute(_QUERIES["all_states"], self._p()).all()
            logged = conn.execute(_QUERIES["change_count"], self._p()).scalar_one()
        stored = {entry: state for entry, state, _ in rows}
        scores = {entry: float(next_fire) for entry, _, next_fire in rows if next_fire is not None}
        return stored, scores, int(logged)

    def read_states(self, names: list[str]) -> tuple[list[Any], list[float | None]]:
        if not names:
            return [], []
        return self._by_name(names, self._all(_QUERIES["read_states"], names=list(names)))

    @staticmethod
    def _by_name(names: list[str], rows: Sequence[Any]) -> tuple[list[Any], list[float | None]]:
        found = {entry: (state, next_fire) for entry, state, next_fire in rows}
        raws = [found[n][0] if n in found else None for n in names]
        scores = [float(found[n][1]) if n in found and found[n][1] is not None else None for n in names]
        return raws, scores

    def due_count(self) -> int:
        # the trigger-kept count (safe_time_beat_counts), not a count of the due index: a takeover
        # asks for it, and at a million entries counting takes a tenth of a second
        return int(self._one(_QUERIES["due_count"])[0])

    def write_plan(
        self, token: str, states: dict[str, str], nexts: dict[str, float], gone: list[str], idle: list[str]
    ) -> bool:
        with self.engine().begin() as conn:
            if conn.execute(_QUERIES["holds_lease_for_plan"], self._p(token=token)).first() is None:
                return False
            names = list(states)
            if names:
                conn.execute(
                    _QUERIES["plan_states"],
                    self._p(names=names, states=[states[n] for n in names], nexts=[nexts[n] for n in names]),
                )
            if gone:
                conn.execute(_QUERIES["plan_gone"], self._p(names=list(gone)))
            if idle:
                conn.execute(_QUERIES["plan_idle"], self._p(names=list(idle)))
        return True

    # --- runtime entries: the leader's side ----------------------------------------------
    def change_log(self, since: int | None = None, limit: int | None = None) -> Scored:
        rows = self._all(_QUERIES["change_log"], since=-1 if since is None else since, limit=limit)  # LIMIT NULL: all
        return [(name, float(version)) for name, version in rows]

    def run_now_requests(self) -> dict[str, str]:
        return dict(self._all(_QUERIES["snapshot_run_now"]))

    def read_changed(self, names: list[str]) -> tuple[list[Any], list[Any], list[float | None]]:
        found = dict(self._all(_QUERIES["read_changed_definitions"], names=list(names)))
        states, scores = self.read_states(names)
        return [found.get(n) for n in names], states, scores

    def prune(self, version: int, names: list[str]) -> None:
        if names:
            self._exec(_QUERIES["prune_changes"], names=list(names), version=version)

    def mark_applied(self, token: str, marker: str) -> None:
        self._exec(_QUERIES["mark_applied"], token=token, marker=marker)

    def run_now_done(self, name: str, slot_ms: str) -> None:
        self._exec(_QUERIES["run_now_done"], name=name, slot_ms=slot_ms)

    # --- runtime entries: the API side (any process) ----------------------------------------
    def _writing(self) -> Any:
        """A transaction holding this app's change counter row: writers of definitions take turns, so
        versions are committed in the order they are handed out (the leader never skips one)."""
        self.ensure_tables()
        return self.engine().begin()

    def _locked_version(self, conn: Any) -> int:
        conn.execute(_QUERIES["meta_row"], self._p())
        return int(conn.execute(_QUERIES["lock_version"], self._p()).scalar_one())

    def _bump(self, conn: Any, name: str | None, version: int) -> int:
        version += 1
        conn.execute(_QUERIES["set_version"], self._p(v=version))
        if name is not None:
            conn.execute(_QUERIES["log_change"], self._p(name=name, v=version))
        return version

    def _definition(self, conn: Any, name: str) -> str | None:
        value = conn.execute(_QUERIES["definition"], self._p(name=name)).scalar_one_or_none()
        return None if value is None else str(value)

    def _put(self, conn: Any, name: str, raw: str) -> None:
        conn.execute(_QUERIES["put_definition"], self._p(name=name, raw=raw))

    def _audited(self, conn: Any, name: str, audit: str | None, old: str | None, new: str | None, version: int) -> int:
        """Append the audit record of a change in its transaction (with the definition it replaced)."""
        if audit is not None and self.config.beat_audit_size > 0:
            self._append_audit(conn, name, with_definitions(audit, old, new, version))
        return version

    def _append_audit(self, conn: Any, name: str, record: str) -> None:
        conn.execute(
            _QUERIES["audit_append"], self._p(name=name, record=record, audit_size=self.config.beat_audit_size)
        )

    def entry_save(self, name: str, raw: str, audit: str | None = None, seed: Seed | None = None) -> int:
        with self._writing() as conn:
            version = self._locked_version(conn)
            old = self._definition(conn, name)
            if old == raw:
                return 0
            self._put(conn, name, raw)
            version = self._audited(conn, name, audit, old, raw, self._bump(conn, name, version))
            self._seed(conn, [(name, seed, version)])
            return version

    def _seed(self, conn: Any, rows: list[tuple[str, Seed | None, int]]) -> None:
        """Write the seeds of (name, seed, version) rows (``seed_states``): each distinct seed once."""
        shards = self.config.beat_shards
        table: dict[Seed, int] = {}  # entries planned alike share a seed (the same tuple): sent once
        items = [
            (name, table.setdefault(seed, len(table)), version, self._shard_ns_of(name) if shards > 1 else None)
            for name, seed, version in rows
            if seed is not None and version > 0
        ]
        if items:
            conn.execute(
                _QUERIES["seed_states"],
                self._p(
                    items=json.dumps(items), seeds=json.dumps(list(table)), sns=shard_ns(self.config, 0),
                    unfired=UNFIRED_STATE_PREFIX,
                ),
            )  # fmt: skip

    def entry_seed_many(self, rows: list[tuple[str, Seed | None, int]]) -> None:
        with self.autocommit() as conn:
            self._seed(conn, rows)

    def entry_save_many(
        self, items: list[tuple[str, str]], audit: str | None = None, seeds: list[Seed | None] | None = None
    ) -> list[int]:
        """:meth:`entry_save` of each item in one transaction: one statement for a chunk of distinct
        names (``save_definitions``), else one per table (a name that comes twice compares with its
        earlier definition, as one save after the other would). The seeds follow in a transaction of
        their own (:attr:`seeds_apart`)."""
        if not items:
            return []
        names = [name for name, _ in items]
        kept = audit if self.config.beat_audit_size > 0 else None
        save = self._save_in_turn if len(set(names)) < len(names) else self._save_distinct
        with self._writing() as conn:
            out = save(conn, items, kept, self._locked_version(conn))
        if seeds is not None:
            self.entry_seed_many(list(zip(names, seeds, out, strict=True)))
        return out

    def _save_distinct(self, conn: Any, items: list[tuple[str, str]], audit: str | None, version: int) -> list[int]:
        """A chunk of distinct names in one statement (``save_definitions``)."""
        out = [0] * len(items)
        changed = conn.execute(
            _QUERIES["save_definitions"],
            self._p(
                items=json.dumps(items), version=version, audited=audit is not None,
                audit_head=audit[:-1] if audit is not None else "", keep=max(self.config.beat_audit_size - 1, 0),
            ),
        )  # fmt: skip
        for ord_, v in changed:
            out[ord_ - 1] = int(v)
        return out

    def _save_in_turn(self, conn: Any, items: list[tuple[str, str]], audit: str | None, version: int) -> list[int]:
        """A chunk with a name twice, compared entry by entry here; the writes a statement per table."""
        names = list(dict.fromkeys(name for name, _ in items))
        current: dict[str, str | None] = dict(conn.execute(_QUERIES["stored_definitions"], self._p(names=names)).all())
        out: list[int] = []
        audits: list[tuple[str, str]] = []
        for name, raw in items:
            old = current[name]
            if old == raw:
                out.append(0)
                continue
            version += 1
            out.append(version)
            current[name] = raw
            if audit is not None:
                audits.append((name, with_definitions(audit, old, raw, version)))
        if not any(out):
            return out
        # the last version of each name changed (a name twice: the later one, as one at a time)
        last = {name: v for (name, _), v in zip(items, out, strict=True) if v}
        changed = list(last)
        conn.execute(_QUERIES["set_version"], self._p(v=version))
        conn.execute(_QUERIES["put_definitions"], self._p(names=changed, raws=[current[n] for n in changed]))
        conn.execute(_QUERIES["log_changes"], self._p(names=changed, versions=[last[n] for n in changed]))
        if audits:
            conn.execute(
                _QUERIES["audit_append_many"],
                self._p(names=[n for n, _ in audits], records=[r for _, r in audits]),
            )
            conn.execute(
                _QUERIES["audit_trim_many"],
                self._p(names=list(dict.fromkeys(n for n, _ in audits)), audit_size=self.config.beat_audit_size),
            )
        return out

    def entry_delete(self, name: str, audit: str | None = None) -> int:
        with self._writing() as conn:
            version = self._locked_version(conn)
            old = self._definition(conn, name)
            if conn.execute(_QUERIES["delete_definition"], self._p(name=name)).first() is None:
                return 0
            return self._audited(conn, name, audit, old, None, self._bump(conn, name, version))

    def swap_definition(self, name: str, expected: Any, new: str, audit: str | None = None) -> int:
        expected_text = expected.decode() if isinstance(expected, bytes) else expected
        with self._writing() as conn:
            version = self._locked_version(conn)
            if self._definition(conn, name) != expected_text:
                return -1
            if expected_text == new:
                return 0
            self._put(conn, name, new)
            return self._audited(conn, name, audit, expected_text, new, self._bump(conn, name, version))

    # --- run history and change audit ---------------------------------------------------
    def history_record(self, name: str, slot: float, record: str) -> None:
        if self.config.beat_history_size <= 0:
            return
        self.ensure_tables()
        size = self.config.beat_history_size
        self._exec(_QUERIES["history_record"], entry=name, slot_ms=int(slot_id(slot)), record=record, history_size=size)

    def history_outcome(self, name: str, slot: float, outcome: str) -> bool:
        self.ensure_tables()
        with self.autocommit() as conn:
            result = conn.execute(
                _QUERIES["history_outcome"], self._p(entry=name, slot_ms=int(slot_id(slot)), outcome=outcome)
            )
        return bool(result.rowcount)

    def history(self, name: str, limit: int) -> list[tuple[Any, Any]]:
        self.ensure_tables()
        return [(record, outcome) for record, outcome in self._all(_QUERIES["history_read"], entry=name, limit=limit)]

    def audit_append(self, name: str, record: str) -> None:
        if self.config.beat_audit_size <= 0:
            return
        self.ensure_tables()
        with self.autocommit() as conn:
            self._append_audit(conn, name, record)

    def audit(self, name: str, limit: int) -> list[Any]:
        self.ensure_tables()
        return [row[0] for row in self._all(_QUERIES["audit_read"], name=name, limit=limit)]

    def entry_run_now(self, name: str, slot_ms: str) -> int:
        with self._writing() as conn:
            version = self._locked_version(conn)
            conn.execute(_QUERIES["run_now"], self._p(name=name, slot_ms=slot_ms))
            return self._bump(conn, None, version)

    def entry_definition(self, name: str) -> Any:
        self.ensure_tables()
        with self.autocommit() as conn:
            return self._definition(conn, name)

    def entry_definitions(self, prefix: str | None = None) -> dict[str, Any]:
        self.ensure_tables()
        return dict(self._all(_QUERIES["definitions"], prefix=prefix or ""))

    def entry_rows(self, names: list[str]) -> tuple[list[Any], list[float | None], list[float | None]]:
        if not names:
            return [], [], []
        self.ensure_tables()
        with self.autocommit() as conn:
            if self.config.beat_shards > 1:  # each name's state in its shard's rows
                by_shard: dict[str, list[str]] = {}
                for name in names:
                    by_shard.setdefault(self._shard_ns_of(name), []).append(name)
                found = [
                    row
                    for sns, part in by_shard.items()
                    for row in conn.execute(_QUERIES["read_states"], self._p(sns=sns, names=part)).all()
                ]
            else:
                found = list(conn.execute(_QUERIES["read_states"], self._p(names=list(names))).all())
            states, scores = self._by_name(names, found)
            rows = conn.execute(_QUERIES["change_versions"], self._p(names=list(names))).all()
        versions = {name: float(version) for name, version in rows}
        return states, scores, [versions.get(n) for n in names]

    def entry_seed_state(self, name: str, state: str) -> None:
        self.ensure_tables()
        self._exec(_QUERIES["seed_state"], sns=self._shard_ns_of(name), entry=name, state=state)

    def slot_fired(self, name: str, slot: float) -> bool:
        self.ensure_tables()
        return bool(self._all(_QUERIES["slot_fired"], entry=name, slot_ms=int(slot_id(slot))))

    def claim_slots(self, name: str, slots: list[float], marker: str) -> list[bool]:
        if not slots:
            return []
        self.ensure_tables()
        ids = [int(slot_id(slot)) for slot in slots]
        claimed = asked_again_if_broken(
            self.autocommit,
            lambda conn: {int(row[0]) for row in conn.execute(
                _QUERIES["claim_slots"], self._p(entry=name, slots=ids, marker=marker)
            )},
            logging.WARNING,
            "beat: the PostgreSQL connection broke during a backfill claim (%s); asking again",
        )  # fmt: skip
        return [slot_ms in claimed for slot_ms in ids]

    # --- housekeeping -------------------------------------------------------------
    def prune_fired(self, token: str) -> int:
        """Delete fired-slot rows older than ``FIRED_SLOT_TTL``, and the runs and changes of entries
        deleted ``BEAT_DELETED_HISTORY_KEEP`` ago (leader only: the lease is checked)."""
        with self.autocommit() as conn:
            result = conn.execute(_QUERIES["prune_fired"], self._p(token=token, ttl=float(C.FIRED_SLOT_TTL)))
            conn.execute(_QUERIES["prune_deleted"], self._p(token=token, keep=float(C.BEAT_DELETED_HISTORY_KEEP)))
        return int(result.rowcount or 0)
