"""The PostgreSQL beat backend's SQL, its connections and its reads that never read every entry.

:class:`PostgresReads` is the base of :class:`~.postgres.PostgresBeatBackend`: the tables
(``beat/sql/schema.sql``), every statement (``beat/sql/queries.sql``), the pooled engine, and what a
leader with many runtime entries reads instead of loading them all (``reads_due_only``): the
definitions of the names it asks for, the definitions and the planned names a chunk at a time (keyset
pages of the primary keys), the change counter and marker without the definitions, and the pause
expiries (``safe_time_beat_pause_expiry``); with them the operator views' pages and counts, each on
an index.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from ... import constants as C
from ...config import SafeTimeConfig
from ...coordination import coordination_engine
from ...sql.named import named_statements
from .base import BeatBackend, EntryCounts, Snapshot

#: The tables, their indexes and the counting trigger (``beat/sql/schema.sql``), run in order.
DDL = tuple(named_statements("celery_safe_time.beat", "sql/schema.sql").values())

#: What :data:`DDL` makes, by kind: the parameters of the ``schema_present`` query.
_MADE = "\n".join(DDL)
_TRIGGERS = re.findall(r"CREATE TRIGGER (\w+) \w+ \w+ ON (\w+)", _MADE)
SCHEMA_OBJECTS = {
    "relations": re.findall(r"CREATE (?:TABLE|INDEX) IF NOT EXISTS (\w+)", _MADE),
    "functions": re.findall(r"CREATE FUNCTION (\w+)", _MADE),
    "triggers": [name for name, _table in _TRIGGERS],
    "trigger_tables": [table for _name, table in _TRIGGERS],
}

#: Every statement the backend runs (``beat/sql/queries.sql``), by name.
_QUERIES = {name: sa.text(sql) for name, sql in named_statements("celery_safe_time.beat", "sql/queries.sql").items()}


def prefix_end(prefix: str) -> str | None:
    """The first string after every string starting with ``prefix`` in code point order (its last
    character the next one), None when there is none (every character the last code point)."""
    chars = list(prefix)
    while chars:
        code = ord(chars[-1]) + 1
        if 0xD800 <= code <= 0xDFFF:  # surrogates are no characters UTF-8 can store: step over them
            code = 0xE000
        if code <= 0x10FFFF:
            return "".join(chars[:-1]) + chr(code)
        chars.pop()
    return None


def shard_ns(config: SafeTimeConfig, shard: int) -> str:
    """The ``ns`` of shard ``shard``'s own rows (``safe_time_beat_shards``): shard 0's is the app's key
    prefix (the rows one leader always had), shard N's the prefix and ``beat:shard:N:``, as its Redis keys."""
    return config.key_prefix if shard == 0 else config.key_prefix + C.KEY_BEAT_SHARD_NAMESPACE.format(shard=shard)


class PostgresReads(BeatBackend):
    """The connections, the tables and the index reads of :class:`~.postgres.PostgresBeatBackend`."""

    def __init__(self, config: SafeTimeConfig, shard: int = 0) -> None:
        super().__init__(config)
        #: every row of this app carries its key prefix: apps sharing a database stay apart
        self.ns = config.key_prefix
        #: the namespace of this shard's own rows (lease, state, applied marker, pause expiries)
        self.shard = shard
        self.sns = shard_ns(config, shard)
        self._tables_ready = False

    def engine(self) -> sa.Engine:
        return coordination_engine(self.config)

    def autocommit(self) -> sa.Connection:
        """A pooled connection where each statement commits by itself (one round trip, no BEGIN)."""
        return self.engine().connect().execution_options(isolation_level="AUTOCOMMIT")

    def ensure_tables(self) -> None:
        """Create the beat tables if any is missing (asks once per process; every statement is
        idempotent, and runs under an advisory lock so that beats starting together take turns)."""
        if self._tables_ready:
            return
        with self.autocommit() as conn:
            present = bool(conn.execute(_QUERIES["schema_present"], SCHEMA_OBJECTS).scalar_one())
        if not present:
            with self.engine().begin() as conn:
                conn.execute(_QUERIES["schema_lock"], {"key": C.BEAT_SCHEMA_LOCK_KEY})
                # Asked again under the lock: the beat that held it may have made the whole schema
                # while this one waited, and DDL run beside its writers deadlocks with them.
                if not conn.execute(_QUERIES["schema_present"], SCHEMA_OBJECTS).scalar_one():
                    for statement in DDL:
                        conn.execute(sa.text(statement))
        self._tables_ready = True

    def _p(self, **extra: Any) -> dict[str, Any]:
        return {"ns": self.ns, "sns": self.sns, **extra}

    def _all(self, query: sa.TextClause, **params: Any) -> Sequence[Any]:
        """The rows of ``query`` with :meth:`_p` of ``params``, on an autocommit connection."""
        with self.autocommit() as conn:
            return conn.execute(query, self._p(**params)).all()

    def _one(self, query: sa.TextClause, **params: Any) -> Any:
        """The one row of ``query``, as :meth:`_all`."""
        with self.autocommit() as conn:
            return conn.execute(query, self._p(**params)).one()

    def _exec(self, query: sa.TextClause, **params: Any) -> None:
        """Run ``query``, as :meth:`_all`, for what it writes."""
        with self.autocommit() as conn:
            conn.execute(query, self._p(**params))

    # --- reading what is due (a leader with many runtime entries) ---------------------------------
    reads_due_only = True

    def change_count(self) -> int:
        return int(self._one(_QUERIES["change_count"])[0])

    def definitions(self, names: list[str]) -> list[Any]:
        if not names:
            return []
        found = dict(self._all(_QUERIES["read_changed_definitions"], names=list(names)))
        return [found.get(name) for name in names]

    def _pages(self, query: sa.TextClause, chunk: int) -> Iterator[Sequence[Any]]:
        """The rows of ``query`` (a keyset page: names after ``:after``, in order, ``:limit`` of them),
        page after page; each page a statement of its own, so nothing is held between two."""
        after = ""
        while True:
            rows = self._all(query, after=after, limit=max(1, chunk))
            if rows:
                yield rows
            if len(rows) < max(1, chunk):
                return
            after = rows[-1][0]

    def scan_definitions(self, chunk: int) -> Iterator[dict[str, Any]]:
        for rows in self._pages(_QUERIES["scan_definitions"], chunk):
            yield {name: raw for name, raw in rows}

    def scan_planned(self, chunk: int) -> Iterator[list[str]]:
        for rows in self._pages(_QUERIES["scan_planned"], chunk):
            yield [row[0] for row in rows]

    def snapshot_meta(self) -> Snapshot:
        return self._snapshot(definitions=False)

    def _snapshot(self, *, definitions: bool) -> Snapshot:
        # one consistent read: the counter matches the definitions and the marker the state
        with self.engine().connect().execution_options(isolation_level="REPEATABLE READ") as conn, conn.begin():
            meta = conn.execute(_QUERIES["snapshot_meta"], self._p()).one()
            found = conn.execute(_QUERIES["snapshot_entries"], self._p()).all() if definitions else []
            requests = conn.execute(_QUERIES["snapshot_run_now"], self._p()).all()
        return Snapshot(version=int(meta[0] or 0), definitions=dict(found), requests=dict(requests), marker=meta[1])

    def pause_expiries(self) -> dict[str, float]:
        return {name: float(at) for name, at in self._all(_QUERIES["pause_expiries"])}

    def set_pause_expiries(self, add: dict[str, float], remove: list[str], *, replace: bool = False) -> None:
        if not (add or remove or replace):
            return
        names = list(add)
        with self.engine().begin() as conn:
            if replace or remove:
                conn.execute(_QUERIES["pause_expiries_drop"], self._p(every=replace, names=list(remove)))
            if names:
                conn.execute(_QUERIES["pause_expiries_add"], self._p(names=names, ats=[add[n] for n in names]))

    # --- operator views ---------------------------------------------------------------
    def entry_page(self, after: str | None, limit: int, prefix: str | None = None) -> list[tuple[str, Any]]:
        if limit <= 0:
            return []
        self.ensure_tables()
        # COLLATE "C" (the names' own collation, so their primary key's order): code point order, as
        # Redis and Python order names, whatever the database's collation; a prefix is a range of it.
        high = prefix_end(prefix) if prefix else None
        if prefix and high is not None:
            rows = self._all(_QUERIES["entry_page_prefix"], after=after or "", low=prefix, high=high, limit=limit)
        else:
            rows = self._all(_QUERIES["entry_page"], after=max(after or "", prefix or ""), limit=limit)
        return [(name, raw) for name, raw in rows if not prefix or name.startswith(prefix)]

    def entry_counts(self, soon: float) -> EntryCounts:
        self.ensure_tables()
        nss = [shard_ns(self.config, shard) for shard in range(self.config.beat_shards)]
        definitions, scheduled, due_soon = self._one(_QUERIES["entry_counts"], soon=soon, shard_nss=nss)
        return EntryCounts(definitions=int(definitions), scheduled=int(scheduled), due_soon=int(due_soon))

    def definition_count(self) -> int:
        self.ensure_tables()
        return int(self._one(_QUERIES["definition_count"])[0])
