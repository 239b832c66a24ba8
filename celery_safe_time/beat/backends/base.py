"""The beat backend seam: where the leader lease, the fired-slot guard and the schedule state live.

One interface (:class:`BeatBackend`, with its :class:`BeatLease`), one module per backend:

- :mod:`.redis`: Lua scripts over Redis keys (the default; ``safe_time_redis_url``);
- :mod:`.postgres`: tables of the coordination database (``safe_time_coordination_url``);
- :mod:`.memory`: dicts in this process, for unit tests.

The scheduler (:mod:`..scheduler`) holds every rule (what is due, misfires, re-planning); a backend
only stores and guards. Its vocabulary is the Redis one: a *state* per entry (the JSON of
:func:`..state.dump_state`) and a *due set* (each scheduled entry's next fire time; a paused entry
keeps its state but leaves the due set).
"""

from __future__ import annotations

import abc
import dataclasses
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from ... import constants as C
from ...clock import ServerClock
from ...config import SafeTimeConfig
from ...exceptions import ImproperlyConfigured, SafeTimeError
from ..shards import BeatPulse
from ..state import identity

#: (member, score) pairs: entry names and their next fire time.
Scored = list[tuple[str, float]]

#: What a save plans for an entry (:meth:`BeatBackend.entry_save`): its state JSON and its due score.
Seed = tuple[str, float]

#: How the JSON of a state that never fired begins (:func:`..state.dump_state` writes ``last`` first):
#: a save replaces such a state with its own seed, as a leader would re-plan it.
UNFIRED_STATE_PREFIX = '{"last": null, '


@dataclasses.dataclass(frozen=True)
class SlotWrite:
    """One entry's state change in a tick: dispatch ``slot`` (publish it) or, with no slot, advance."""

    entry: str
    state: str
    next_fire: float
    slot: float | None = None
    #: the run history record of a dispatch (JSON, ``beat/history.py``), written with it when it is fresh
    history: str | None = None


@dataclasses.dataclass(frozen=True)
class DueRead:
    """What one idle tick reads in one round trip (see ``SafeScheduler._read_due``)."""

    due: Scored
    due_count: int
    state_count: int
    #: the runtime entries' change counter (0 where there are none)
    version: int
    #: the first entry of the due set (how long to sleep when nothing is due); may be empty when that
    #: entry is more than ``BEAT_HEAD_WINDOW`` after ``now`` (the tick then sleeps its granularity)
    head: Scored


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a new leader reads first, consistently: the runtime entries and the applied marker."""

    version: int
    definitions: dict[str, Any]
    requests: dict[str, str]
    marker: str | None


@dataclasses.dataclass(frozen=True)
class EntryCounts:
    """The sizes the operator views show, each read from an index (never by reading every entry)."""

    #: runtime definitions stored
    definitions: int
    #: entries in the due set (config and runtime ones the leader schedules)
    scheduled: int
    #: entries of the due set whose next fire is at or before the ``soon`` asked for
    due_soon: int


@dataclasses.dataclass(frozen=True)
class ShardView:
    """One shard (``safe_time_beat_shards``; the one leader's with one shard) as the operator views see it."""

    lease: LeaseView
    #: entries in its due set
    scheduled: int
    #: of them, entries due at ``lease.now`` (not fired yet)
    due_now: int
    #: when the first entry of its due set is due (None: the set is empty)
    oldest_due: float | None


@dataclasses.dataclass(frozen=True)
class LeaseView:
    """The lease as ``status``, probes and metrics see it."""

    #: the holder's info (host, pid, epoch, since, lease, token prefix); {} when no beat holds it
    info: dict[str, Any]
    #: milliseconds left on the lease (None when nobody holds it)
    ttl_ms: int | None
    #: the last epoch handed out (None before the first)
    epoch: int | None
    #: the authority's clock when read (UNIX seconds)
    now: float


class BeatLease(abc.ABC):
    """One beat's handle on the leader lease and the guarded dispatch.

    Not thread-safe by itself: the lease thread is the only caller of acquire/renew/release; the
    dispatch methods only read :attr:`token`.
    """

    #: When the last :meth:`acquire` sent its request (``time.monotonic``), set by a backend whose
    #: acquire first prepares (creates its tables): the lease runs from the request, not the preparation.
    #: None: from when ``acquire`` was called.
    sent_at: float | None = None

    def __init__(self, config: SafeTimeConfig, info: dict[str, Any] | None = None) -> None:
        self.config = config
        self.token = uuid.uuid4().hex
        self.info = dict(info or identity())
        self.epoch: int | None = None

    def holder_info(self, now: float) -> dict[str, Any]:
        """The leader info an acquire at ``now`` writes with the lease (the backend adds the epoch)."""
        return {**self.info, "token": self.token[:8], "since": now, "lease": self.config.beat_lease}

    @abc.abstractmethod
    def acquire(self, now: float) -> int | None:
        """Take (or keep) the lease; return the epoch, or None while another beat holds it."""

    @abc.abstractmethod
    def renew(self) -> bool:
        """Extend the lease this beat holds; False (and ``epoch`` None) when it is gone."""

    @abc.abstractmethod
    def release(self) -> bool:
        """Give the lease up (only if this beat holds it)."""

    @abc.abstractmethod
    def write_slots(self, epoch: int, writes: list[SlotWrite]) -> list[int]:
        """A tick's dispatches and advances, guarded by the lease, in one round trip: per write 1
        (publish; an advance always answers 1), 0 (slot already fired: do not publish), -1 (not the leader)."""

    @abc.abstractmethod
    def dispatch_slot(self, epoch: int, entry: str, slot: float) -> int:
        """The dispatch check alone, for a scheduler whose state lives elsewhere: 1, 0 or -1."""

    @abc.abstractmethod
    def forget(self, epoch: int, names: list[str], *, keep_state: bool) -> bool:
        """Take ``names`` out of the due set (and, unless ``keep_state``, their state); False when
        this beat is not the leader."""

    def dispatch(self, epoch: int, entry: str, slot: float, state: str, next_fire: float) -> int:
        """One guarded dispatch with its state write: 1, 0 or -1 as :meth:`write_slots`."""
        return self.write_slots(epoch, [SlotWrite(entry, state, next_fire, slot)])[0]


class BeatBackend(abc.ABC):
    """The storage of one app's beats (see the module docstring)."""

    #: ``redis``, ``postgres`` or ``memory``
    name: str
    #: the name in log lines ("Redis", "PostgreSQL")
    label: str
    #: what a failing backend raises during a tick or a lease round (the beat then stands by)
    errors: tuple[type[Exception], ...]
    clock: ServerClock
    #: the names log lines give the due set and the state (a Redis key, a table)
    due_name: str
    state_name: str

    #: the shard whose lease, state and due set this object reads and writes (``safe_time_beat_shards``)
    shard: int = 0
    #: whether the beats publish heartbeats here (:meth:`beats_heartbeat`): with shards, and with one
    #: leader too, so that beats with different ``safe_time_beat_shards`` see each other
    keeps_heartbeats: bool = False

    def __init__(self, config: SafeTimeConfig) -> None:
        self.config = config

    # --- shards (``beat/shards.py``) --------------------------------------------------
    # Not abstract: a backend without them refuses ``safe_time_beat_shards`` above 1 at startup.
    def for_shard(self, shard: int) -> BeatBackend:
        """This backend for ``shard``: its own lease, epoch, state, due set and applied marker; the
        definitions, the change log and the fired-slot markers shared with every shard."""
        raise ImproperlyConfigured(
            "safe_time_beat_shards",
            f"{self.config.beat_shards} shards need Redis or PostgreSQL coordination: the {self.label} beat "
            "backend has one leader lease (set it to 1)",
        )

    def beats_heartbeat(self, member: str, pulse: BeatPulse, window: float) -> dict[str, BeatPulse]:
        """Record beat ``member``'s ``pulse``; the live beats' pulses (seen within ``window`` seconds of
        ``pulse.seen``, this one included). Older heartbeats are dropped."""
        raise NotImplementedError

    @staticmethod
    def _pulses(stored: Iterable[tuple[str, str]]) -> dict[str, BeatPulse]:
        """Stored (member, pulse) heartbeats as pulses by member, those that parse."""
        loaded = {member: BeatPulse.load(raw) for member, raw in stored}
        return {member: pulse for member, pulse in loaded.items() if pulse is not None}

    def beats_gone(self, member: str) -> None:  # noqa: B027 (only a backend with shards keeps heartbeats)
        """Drop beat ``member``'s heartbeat (it stops)."""

    def shard_view(self) -> ShardView:
        """This shard's lease and due set, for the operator's views (a backend may read it in fewer
        round trips)."""
        lease = self.lease_view()
        head = self.head(1)
        due_now = sum(1 for _, score in self.head(C.BEAT_DUE_BATCH) if score <= lease.now) if head else 0
        return ShardView(lease, self.due_count(), due_now, head[0][1] if head else None)

    def beats_seen(self) -> dict[str, BeatPulse]:
        """Every beat heartbeat stored (live or not: the reader judges by ``seen``), for the operator's
        views; empty on a backend without shards."""
        return {}

    # --- the lease ------------------------------------------------------------------
    @abc.abstractmethod
    def make_lease(self, *, info: dict[str, Any] | None = None) -> BeatLease:
        """A new lease handle (a new token) for one beat."""

    @abc.abstractmethod
    def lease_view(self) -> LeaseView:
        """The lease as it is now (``status``, probes, the banner)."""

    @abc.abstractmethod
    def holds_lease(self, token: str) -> bool:
        """True when ``token`` holds the lease right now."""

    # --- connection ---------------------------------------------------------------
    @abc.abstractmethod
    def where(self) -> str:
        """The backend's address for the banner and errors, password masked."""

    @abc.abstractmethod
    def startup_checks(self, who: str) -> None:
        """Fail loudly when unreachable; warn about what would make the guard unsafe."""

    def ensure_tables(self) -> None:  # noqa: B027 (only a database backend has tables to make)
        """Make what the backend keeps its state in, where that is made (PostgreSQL's tables)."""

    # --- ticks --------------------------------------------------------------------
    @abc.abstractmethod
    def read_due(self, now: float, limit: int) -> DueRead:
        """The entries due at ``now`` (at most ``limit``), the counts and the head, in one round trip."""

    @abc.abstractmethod
    def head(self, limit: int = 1) -> Scored:
        """The first ``limit`` entries of the due set."""

    @abc.abstractmethod
    def drop_due(self, name: str) -> None:
        """Take ``name`` out of the due set (an entry the leader no longer plans)."""

    # --- re-planning (a new leader) -----------------------------------------------------
    @abc.abstractmethod
    def snapshot(self) -> Snapshot:
        """The change counter, every runtime definition, the run-now requests and the applied marker."""

    @abc.abstractmethod
    def read_all(self) -> tuple[dict[str, Any], dict[str, float], int]:
        """Every entry's raw state, every due score, and the length of the change log."""

    @abc.abstractmethod
    def read_states(self, names: list[str]) -> tuple[list[Any], list[float | None]]:
        """The raw states and due scores of ``names`` (None where absent)."""

    @abc.abstractmethod
    def due_count(self) -> int:
        """How many entries the due set holds."""

    @abc.abstractmethod
    def write_plan(
        self, token: str, states: dict[str, str], nexts: dict[str, float], gone: list[str], idle: list[str]
    ) -> bool:
        """A re-plan: write ``states`` and their ``nexts``, drop ``gone`` (state too), unschedule ``idle``
        (state kept); only while ``token`` holds the lease (False, nothing written, otherwise)."""

    # --- runtime entries (a backend without them answers empty) -----------------------------
    @abc.abstractmethod
    def change_log(self, since: int | None = None, limit: int | None = None) -> Scored:
        """(name, version) of the runtime entries changed after ``since`` (None: all), oldest first."""

    @abc.abstractmethod
    def run_now_requests(self) -> dict[str, str]:
        """Pending ``beat run-now`` requests: name -> slot in milliseconds."""

    @abc.abstractmethod
    def read_changed(self, names: list[str]) -> tuple[list[Any], list[Any], list[float | None]]:
        """Definitions, raw states and due scores of ``names``."""

    @abc.abstractmethod
    def prune(self, version: int, names: list[str]) -> None:
        """Drop the tombstones of deleted ``names`` applied up to ``version``."""

    @abc.abstractmethod
    def mark_applied(self, token: str, marker: str) -> None:
        """Record (leader only) which change the state reflects (``"<version> <fingerprint>"``)."""

    @abc.abstractmethod
    def run_now_done(self, name: str, slot_ms: str) -> None:
        """Drop the run-now request of ``name`` for ``slot_ms`` (a newer one stays)."""

    @abc.abstractmethod
    def swap_definition(self, name: str, expected: Any, new: str, audit: str | None = None) -> int:
        """Compare-and-set of ``name``'s definition: -1 changed meanwhile, 0 unchanged, else the version.

        ``audit`` (here and in :meth:`entry_save`, :meth:`entry_delete`): the JSON object of an audit
        record without its definitions (``history.audit_meta``); a change appends it, with the old
        and new definitions and the version, atomically with the change."""

    # --- runtime entries: the API side (``beat/entries.py``, any process) ---------------------
    @abc.abstractmethod
    def entry_save(self, name: str, raw: str, audit: str | None = None, seed: Seed | None = None) -> int:
        """Upsert ``name``'s definition: 0 when identical (nothing changes), else the new version.

        ``seed``: the entry's state and due score planned from its first slot, written in the shard
        the entry belongs to with a changed definition, where the entry has no state or one that never
        fired (:data:`UNFIRED_STATE_PREFIX`); a state that fired is the leader's to re-plan. A leader
        that never planned the entry then finds it in the due set: a fresh leader fires the entries
        due first instead of planning every entry before it fires any."""

    def entry_save_many(
        self, items: list[tuple[str, str]], audit: str | None = None, seeds: list[Seed | None] | None = None
    ) -> list[int]:
        """:meth:`entry_save` of each (name, definition JSON) with its seed, in one round trip where the
        backend can."""
        seeded: list[Seed | None] = seeds if seeds is not None else [None] * len(items)
        return [self.entry_save(name, raw, audit, seed) for (name, raw), seed in zip(items, seeded, strict=True)]

    #: Whether a bulk save does better to call :meth:`entry_save_many` without seeds and
    #: :meth:`entry_seed_many` after it, on a thread of its own (PostgreSQL: one chunk's seeds are
    #: then written on one core while the next chunk is stored on the other).
    seeds_apart: bool = False

    def entry_seed_many(self, rows: list[tuple[str, Seed | None, int]]) -> None:
        """Write the seeds of entries :meth:`entry_save_many` stored: (name, seed, the version it
        returned; a version of 0 or no seed writes nothing), as :meth:`entry_save` writes its seed,
        and only where the entry's change log still holds that version (a later save plans its own)."""
        raise NotImplementedError

    @abc.abstractmethod
    def entry_delete(self, name: str, audit: str | None = None) -> int:
        """Delete ``name`` (its change log row stays as a tombstone): 0 when there was none, else the version."""

    @abc.abstractmethod
    def entry_definition(self, name: str) -> Any:
        """``name``'s stored definition, None when there is none."""

    @abc.abstractmethod
    def entry_definitions(self, prefix: str | None = None) -> dict[str, Any]:
        """Every runtime definition (of names starting with ``prefix``)."""

    @abc.abstractmethod
    def entry_rows(self, names: list[str]) -> tuple[list[Any], list[float | None], list[float | None]]:
        """Raw states, due scores and change-log versions of ``names`` (None where absent)."""

    @abc.abstractmethod
    def entry_run_now(self, name: str, slot_ms: str) -> int:
        """Ask the leader to publish one slot of ``name`` at ``slot_ms``; returns the new version."""

    @abc.abstractmethod
    def entry_seed_state(self, name: str, state: str) -> None:
        """Give ``name`` this state unless it has one (unscheduled: the leader plans it from the state)."""

    @abc.abstractmethod
    def slot_fired(self, name: str, slot: float) -> bool:
        """Whether ``name``'s ``slot`` was published (its fired-slot record exists)."""

    def claim_slots(self, name: str, slots: list[float], marker: str) -> list[bool]:
        """Mark ``name``'s ``slots`` fired without the lease (a backfill): per slot True when this
        call marked it (publish it), False when it was fired already. ``marker`` is new per call and
        written in each record: the same call run again (its reply lost) still answers True for the
        slots it marked. Not abstract: a backend without it still loads, and refuses a backfill."""
        raise SafeTimeError(f"the {self.label} beat backend cannot backfill (no claim_slots)")

    # --- reading what is due (a leader with many runtime entries, ``SafeScheduler``) --------------
    # Not abstract: the defaults answer from the methods above (a whole read), so a backend without
    # a cheaper way still works; ``reads_due_only`` says whether the leader should use them at scale.
    #: True when the leader may read definitions per due entry rather than load them all at takeover
    reads_due_only: bool = False

    def definition_count(self) -> int:
        """How many runtime definitions are stored."""
        return len(self.entry_definitions())

    def change_count(self) -> int:
        """How many names the change log holds (tombstones included)."""
        return len(self.change_log())

    def definitions(self, names: list[str]) -> list[Any]:
        """The stored definitions of ``names`` (None where there is none), in one round trip."""
        return [self.entry_definition(name) for name in names]

    def scan_definitions(self, chunk: int) -> Iterator[dict[str, Any]]:
        """Every runtime definition, about ``chunk`` at a time (a name may come twice). This default
        reads them all once and hands them out in name order, ``chunk`` at a time (a leader plans
        every entry a chunk per tick: :meth:`~..replan.ReplanningScheduler.replan_step`)."""
        definitions = self.entry_definitions()
        names = sorted(definitions)
        for i in range(0, len(names), max(1, chunk)):
            yield {name: definitions[name] for name in names[i : i + chunk]}

    def scan_planned(self, chunk: int) -> Iterator[list[str]]:
        """The names that have a state or a due score, about ``chunk`` at a time (a name may come twice)."""
        stored, scores, _ = self.read_all()
        yield sorted(set(stored) | set(scores))

    # --- operator views (``beat list``, ``status``, the admin): pages and counts, not whole reads ------
    # Not abstract: the defaults answer from a whole read (:meth:`entry_definitions`), so a backend
    # without an index still works; Redis and PostgreSQL answer from their indexes.
    def entry_page(self, after: str | None, limit: int, prefix: str | None = None) -> list[tuple[str, Any]]:
        """Up to ``limit`` runtime (name, definition) pairs in name order (code point order, as
        Python sorts ``str``): the names after ``after`` (None: from the first) starting with ``prefix``."""
        found = self.entry_definitions(prefix)
        names = sorted(n for n in found if after is None or n > after)[: max(limit, 0)]
        return [(name, found[name]) for name in names]

    def entry_counts(self, soon: float) -> EntryCounts:
        """How many runtime definitions, scheduled entries and entries due by ``soon`` (UNIX seconds)."""
        _, scores, _ = self.read_all()
        return EntryCounts(
            definitions=self.definition_count(),
            scheduled=len(scores),
            due_soon=sum(1 for score in scores.values() if score <= soon),
        )

    def snapshot_meta(self) -> Snapshot:
        """:meth:`snapshot` without the definitions (``definitions`` is empty)."""
        snapshot = self.snapshot()
        return dataclasses.replace(snapshot, definitions={})

    def pause_expiries(self) -> dict[str, float]:
        """Paused runtime entries with an expiry, as the leader recorded them: name -> when it resumes them."""
        return {}

    def set_pause_expiries(self, add: dict[str, float], remove: list[str], *, replace: bool = False) -> None:
        """Record pause expiries (the leader does): add ``add``, drop ``remove``; ``replace`` drops all
        others. A hint only: the leader checks the definition itself before it resumes an entry."""
        return None

    # --- run history and change audit (``beat/history.py``) ------------------------------------
    # Not abstract: a backend without them still loads (and keeps neither).
    def history_record(self, name: str, slot: float, record: str) -> None:
        """Store the published part of a run that no dispatch wrote (a backfill's), trimmed to
        ``beat_history_size`` runs per entry."""
        return None

    def history_outcome(self, name: str, slot: float, outcome: str) -> bool:
        """Set the outcome (JSON) of ``name``'s run of ``slot``; False when that run is not kept."""
        return False

    def history(self, name: str, limit: int) -> list[tuple[Any, Any]]:
        """``name``'s last ``limit`` runs, newest slot first: (published JSON, outcome JSON or None)."""
        return []

    def audit_append(self, name: str, record: str) -> None:
        """Append an audit record (JSON) to ``name``'s, trimmed to ``beat_audit_size``."""
        return None

    def audit(self, name: str, limit: int) -> list[Any]:
        """``name``'s last ``limit`` audit records (JSON), newest first."""
        return []

    # --- housekeeping -------------------------------------------------------------
    def prune_fired(self, token: str) -> int:
        """Delete fired-slot records older than ``FIRED_SLOT_TTL`` (where they do not expire by themselves)."""
        return 0

    def close(self) -> None:  # noqa: B027 (most backends hold nothing of their own)
        """Give back what this backend holds (connections); it may be used again afterwards."""
