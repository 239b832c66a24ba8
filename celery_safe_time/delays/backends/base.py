"""The delayed-task store seam: what every backend (SQLAlchemy, Django ORM, memory) provides.

A store is a table of delayed tasks keyed by task id. Every "when" it decides (is a row due,
has a claim gone stale) is measured with the store's own clock, :meth:`DelayStore.now`, so
processes with wrong local clocks still agree.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

from ... import constants as C
from ...clock import as_utc
from ...exceptions import PurgeRefused, StoreError
from ...sql.named import named_statements


def query(name: str, resource: str = "queries.sql") -> str:
    """The SQL store's statement ``name`` in ``resource`` (``queries.sql``: statements; ``schema.sql``:
    fragments), files of the ``sql`` package beside this module."""
    return named_statements(f"{__package__}.sql", resource)[name]


#: The database's current time per SQLAlchemy dialect / Django vendor, read when the statement runs
#: (not at transaction start); the statements are in ``sql/queries.sql``.
NOW_SQL = {
    "postgresql": query("now_postgresql"),
    "sqlite": query("now_sqlite"),
    "mysql": query("now_mysql"),
    "mariadb": query("now_mysql"),
}

_ROW_TIMES = (
    "due_at",
    "created_at",
    "updated_at",
    "expires_at",
    "claimed_at",
    "sent_at",
    "started_at",
    "heartbeat_at",
    "finished_at",
    "suspected_at",
    "debounce_until",
)


def new_delivery_token() -> str:
    """A row's delivery token: new on every insert and reschedule, published with every copy of it."""
    return uuid.uuid4().hex


#: The wait before a row is published again doubles at most this many times (32 times the grace).
REPUBLISH_DOUBLINGS = 5


def republish_after(grace: float, attempts: int) -> float:
    """Seconds a row ``sent`` on its ``attempts``-th claim waits unstarted before it is published again.

    ``grace`` after its first publish, then twice the wait before for each copy already sent, up to
    ``2 ** REPUBLISH_DOUBLINGS`` times ``grace``. A message queued behind a backlog longer than the
    grace looks lost as well; without the doubling every such row would get another copy every grace,
    each copy a worker run that only finds the row taken, and the backlog would feed itself.
    """
    return grace * float(2 ** min(max(attempts - 1, 0), REPUBLISH_DOUBLINGS))


@dataclasses.dataclass(frozen=True)
class NewDelay:
    """A delayed task about to be stored; times are aware UTC datetimes.

    Give ``due_at``, or ``countdown`` seconds counted from the store's own clock when the row is
    written (no extra round trip to read it first); likewise ``expires_at`` or ``expires_in``.
    """

    id: str
    task: str
    payload: bytes
    content_type: str
    content_encoding: str
    due_at: datetime | None = None
    expires_at: datetime | None = None
    idempotency_key: str | None = None
    countdown: float | None = None
    expires_in: float | None = None
    #: Debounced calls (:meth:`DelayStore.debounce`): seconds from the burst's first call after which
    #: later calls no longer push the row back (None: no cap).
    debounce_max_wait: float | None = None

    def resolve(self, now: datetime) -> tuple[datetime, datetime | None]:
        """``(due_at, expires_at)`` with the relative parts counted from ``now`` (the store's clock)."""
        due_at = self.due_at
        if due_at is None:
            if self.countdown is None:
                raise ValueError("a NewDelay needs due_at or countdown")
            due_at = now + timedelta(seconds=self.countdown)
        expires_at = self.expires_at
        if expires_at is None and self.expires_in is not None:
            expires_at = now + timedelta(seconds=self.expires_in)
        return due_at, expires_at

    def pending_row(self, now: datetime) -> dict[str, Any]:
        """The column values of this delay written as a fresh pending row at store time ``now``."""
        due_at, expires_at = self.resolve(now)
        return {
            "id": self.id,
            "task": self.task,
            "payload": self.payload,
            "content_type": self.content_type,
            "content_encoding": self.content_encoding,
            "due_at": due_at,
            "expires_at": expires_at,
            "status": C.STATUS_PENDING,
            "idempotency_key": self.idempotency_key,
            "attempts": 0,
            "created_at": now,
            "updated_at": now,
            "delivery_token": new_delivery_token(),
            "starts": 0,
            "debounce_until": (
                None if self.debounce_max_wait is None else now + timedelta(seconds=self.debounce_max_wait)
            ),
        }


@dataclasses.dataclass(frozen=True)
class DelayRow:
    """One stored delayed task as read back from a store."""

    id: str
    task: str
    payload: bytes
    content_type: str
    content_encoding: str
    due_at: datetime
    status: str
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None = None
    idempotency_key: str | None = None
    attempts: int = 0
    claimed_at: datetime | None = None
    claim_token: str | None = None
    sent_at: datetime | None = None
    last_error: str | None = None
    #: The delivery record (None on rows stored before it existed).
    delivery_token: str | None = None
    started_at: datetime | None = None
    heartbeat_at: datetime | None = None
    finished_at: datetime | None = None
    outcome: str | None = None
    worker: str | None = None
    started_by: str | None = None
    starts: int = 0
    #: When a sweep or a redelivered copy first found the heartbeat stale. The run counts as dead only
    #: once it stays stale for another ``safe_time_lock_ttl`` after that (a heartbeat since clears it):
    #: a store outage stops every heartbeat at once, and the first look after it must not take over.
    #: Each later look records itself in ``updated_at``; the sweep starts the suspicion over when its
    #: previous look is too old (the store was unreachable between them: see ``end_stale``).
    suspected_at: datetime | None = None
    #: The app (``safe_time_store_namespace``) that stored it; "" from a store built by hand.
    namespace: str = C.SHARED_STORE_NAMESPACE
    #: A debounced row: the latest due time later calls of its burst may move it to (first call plus
    #: the max wait); None on other rows and on debounced rows without a cap.
    debounce_until: datetime | None = None

    @property
    def debounce_key(self) -> str | None:
        """The debounce key (``<task name>:<key>``) of a debounced row, else None."""
        key = self.idempotency_key
        if key is None or not key.startswith(C.DEBOUNCE_KEY_PREFIX):
            return None
        return key[len(C.DEBOUNCE_KEY_PREFIX) :]

    @classmethod
    def from_mapping(cls, values: Mapping[Any, Any]) -> DelayRow:
        """A row from column values as a driver or the ORM returns them (times made aware UTC)."""
        # One plain dict and the field names computed once: a driver's row mapping is slow to probe
        # key by key, and a sweep builds one row object per claimed row.
        given = dict(values)
        fields = {name: given[name] for name in _ROW_FIELDS if name in given}
        fields["payload"] = bytes(fields["payload"])
        fields["starts"] = fields.get("starts") or 0
        for name in _ROW_TIMES:
            if fields[name] is not None:
                fields[name] = as_utc(fields[name])
        return cls(**fields)

    def summary(self) -> dict[str, Any]:
        """Everything but the payload, for listings and the CLI."""
        data = dataclasses.asdict(self)
        data.pop("payload")
        data["payload_bytes"] = len(self.payload)
        data["debounce_key"] = self.debounce_key
        return data


#: DelayRow's field names (``dataclasses.fields`` builds them anew on every call).
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(DelayRow))

StartVerdict = Literal["run", "running", "done", "superseded", "missing", "early"]


@dataclasses.dataclass(frozen=True)
class StartResult:
    """What :meth:`DelayStore.start` decided for one delivery.

    ``run``: this delivery won the conditional start, run the body. ``running``: the same delivery
    runs elsewhere and its heartbeat is fresh (a redelivered copy): re-queue, never drop.
    ``done``: it already ran to an end, or was cancelled, expired or failed: drop this copy.
    ``superseded``: the row has another delivery token now (rescheduled, or replaced by a new call
    with the same task id): this message is stale, drop it. ``missing``: no row (purged after it
    finished): drop it. ``early``: the row is not due yet by the store's clock (a message published
    ahead with its ``eta``, on a worker whose clock is fast): re-queue it for ``early_by`` seconds.
    """

    verdict: StartVerdict
    row: DelayRow | None = None
    #: ``early``: how long before its due time, by the store's clock, this copy tried to start.
    early_by: float = 0.0


def started_values(now: Any, worker: Any, run_id: Any) -> dict[str, Any]:
    """The columns a won start sets, in every backend (``now``/``worker``/``run_id`` may be values or
    SQL binds); each backend adds its own ``starts`` increment and ``updated_at``."""
    return {
        "status": C.STATUS_STARTED,
        "claim_token": None,
        "started_at": now,
        "heartbeat_at": now,
        "finished_at": None,
        "suspected_at": None,
        "outcome": None,
        "worker": worker,
        "started_by": run_id,
    }


def rerun_values(now: Any) -> dict[str, Any]:
    """The columns ``rerun`` sets on a failed or expired row, in every backend: pending, due ``now``,
    a new delivery token, no expiry; its idempotency and debounce keys are given up (a newer call may
    hold them). Each backend adds its own ``updated_at``."""
    return {
        "due_at": now,
        "expires_at": None,
        "idempotency_key": None,
        "debounce_until": None,
        "status": C.STATUS_PENDING,
        "claim_token": None,
        "delivery_token": new_delivery_token(),
    }


def early_by(row: DelayRow | None, now: datetime, leeway: float) -> float:
    """Seconds by which a start at ``now`` (the store's clock) comes before ``row`` is due, beyond
    ``leeway``; 0 when it does not (or there is no row)."""
    if row is None or row.status not in C.DELAY_STARTABLE_STATUSES:
        return 0.0
    early = (row.due_at - now).total_seconds()
    return early if early > leeway else 0.0


def start_verdict(row: DelayRow | None, token: str, early: float = 0.0) -> StartVerdict:
    """Why a conditional start did not win, from the row as it is now (shared by every backend);
    ``early``: :func:`early_by` for that row."""
    if row is None:
        return "missing"
    if row.delivery_token != token:
        return "superseded"
    if early > 0:
        return "early"
    # A startable row: the start would have won (the verdict is "running" all the same).
    if row.status == C.STATUS_STARTED or row.status in C.DELAY_STARTABLE_STATUSES:
        return "running"
    return "done"


@dataclasses.dataclass(frozen=True)
class InsertResult:
    """What :meth:`DelayStore.insert` did: ``created`` is False for an idempotency-key hit."""

    task_id: str
    created: bool
    #: The stored row's due time (the existing row's on an idempotency-key hit, when known).
    due_at: datetime | None = None


class DelayStore(abc.ABC):
    """A durable table of delayed tasks keyed by task id, with its own clock (``now()``)."""

    #: The URL it was built from (masked before it is ever logged).
    url: str = ""
    #: ``safe_time_store_namespace`` of the app this store serves: it claims, lists, counts, cancels
    #: and purges only rows of this namespace and the shared one (""). None (a store built by hand,
    #: without an app) sees every row and stores shared ones.
    namespace: str | None = None
    #: Whether the sweep may make its next claim in a thread of its own while it publishes a batch
    #: (the claim's round trips overlap the publish). Off unless a store's connections are thread-safe
    #: and cost nothing to open from another thread (not Django's, which are per thread).
    claims_in_background: bool = False

    @property
    def scope(self) -> tuple[str, ...] | None:
        """The namespaces this store works on (its own and the shared one), or None for every row."""
        if self.namespace is None:
            return None
        return (self.namespace, C.SHARED_STORE_NAMESPACE)

    def new_row(self, delay: NewDelay, now: datetime) -> dict[str, Any]:
        """The column values of ``delay`` as a fresh pending row of this store's namespace."""
        values = delay.pending_row(now)
        values["namespace"] = self.namespace if self.namespace is not None else C.SHARED_STORE_NAMESPACE
        return values

    @abc.abstractmethod
    def now(self) -> datetime:
        """The database's current time as an aware UTC datetime: the clock that decides "due"."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`~celery_safe_time.exceptions.StoreError` unless the store answers."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (called at process shutdown and by tests)."""

    # --- writes from the caller ----------------------------------------------

    @abc.abstractmethod
    def insert(self, delay: NewDelay) -> InsertResult:
        """Store a pending row.

        With an ``idempotency_key`` already held by a pending row, store nothing and return that
        row's id (``created=False``). A task id whose earlier row is finished (sent, cancelled,
        expired, failed) is replaced: ``retry()`` reuses the task id. A task id that is still
        pending or claimed raises :class:`~celery_safe_time.exceptions.StoreError`.
        """

    @abc.abstractmethod
    def insert_many(self, delays: Sequence[NewDelay]) -> list[InsertResult]:
        """Store many pending rows in one transaction, each as :meth:`insert` would, in order.

        A key held by a pending row, or by an earlier delay of the same batch, stores nothing for that
        delay (``created=False``, the holder's id). All or nothing: a delay that cannot be stored (its
        task id is pending or claimed, earlier in the store or in the batch) raises
        :class:`~celery_safe_time.exceptions.StoreError` with ``index`` set to its position, and no row
        of the batch is stored.
        """

    def debounce(self, delay: NewDelay) -> InsertResult:
        """Store a debounced call: ``delay.idempotency_key`` is its debounce key, ``delay.countdown`` its
        quiet period, ``delay.debounce_max_wait`` its cap. One transaction, atomic against concurrent
        callers and the sweep.

        No pending row holds the key: store ``delay`` as a new row whose ``debounce_until`` is the
        store's now plus the max wait (``created=True``). A pending row holds it: move that row's due
        time to now plus the period, never past its ``debounce_until``, and replace its payload, with a
        new delivery token; return its id (``created=False``) and its new due time. A row the sweep has
        claimed (or sent) holds the key no more: the call starts a new burst.

        Not abstract: a store that does not implement it still loads, and refuses debounced calls.
        """
        raise NotImplementedError(f"{type(self).__name__} does not store debounced calls")

    @abc.abstractmethod
    def cancel(self, task_id: str) -> bool:
        """Mark a row that has not started yet (pending, claimed or sent) cancelled; True when one changed.

        A message already published for it is dropped by the delivery check when it arrives.
        """

    @abc.abstractmethod
    def reschedule(self, task_id: str, due_at: datetime) -> bool:
        """Move a row that has not started yet to ``due_at``, pending, with a new delivery token;
        True when one changed. A message already published for it is stale from now on."""

    @abc.abstractmethod
    def rerun(self, task_id: str) -> bool:
        """Send a failed or expired row back to pending, due at the store's now, with a new delivery
        token and no expiry; True when one changed. It gives up its idempotency key, which a later
        call may hold by now (the row runs once, at once: there is nothing to merge into it)."""

    # --- the delivery record (worker side) --------------------------------------------

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
        """The conditional start of one delivery, one short transaction.

        ``leeway``: a row not started yet wins only once it is due, by the store's clock, within
        ``leeway`` seconds (``early`` otherwise; ``inf``: whenever).

        Wins (``run``) when the row has ``token`` and has not started, or has started and is dead
        (its heartbeat was found older than ``stale_after`` seconds, and stayed so for ``stale_after``
        more: see ``suspected_at``), or was started by one of ``prior_runs`` (our own start whose
        reply was lost). A first look at a stale heartbeat only sets ``suspected_at``. Winning sets
        ``started``, ``started_at``, ``heartbeat_at``, ``worker``, ``started_by=run_id`` and one more
        ``starts``. Otherwise the row is read to say why (:func:`start_verdict`).
        """
        return self._start(task_id, token, run_id, worker, stale_after, prior_runs, leeway)

    @abc.abstractmethod
    def _start(
        self, task_id: str, token: str, run_id: str, worker: str, stale: float, prior: Sequence[str], leeway: float
    ) -> StartResult:
        """The backend's own :meth:`start`."""

    @abc.abstractmethod
    def heartbeat(self, task_id: str, token: str, run_id: str) -> bool:
        """``heartbeat_at`` = now while ``run_id`` still runs this delivery; False when it does not."""

    @abc.abstractmethod
    def finish(
        self, task_id: str, token: str, run_id: str, outcome: str, error: str | None = None, *, durable: bool = True
    ) -> bool:
        """Record the end of ``run_id``'s run: ``finished`` with ``outcome``; False when the row moved on.

        ``durable=False``: the store may answer before the write is on disk (PostgreSQL: without
        waiting for the WAL flush). Only for a run whose lost end cannot make it run again.
        """

    @abc.abstractmethod
    def hand_back(self, task_id: str, token: str, run_id: str) -> bool:
        """``run_id`` handed its message back to the broker (``Reject(requeue=True)``, a message a lost
        worker returns): the row goes back to ``sent``, unfinished, so that message starts it again when
        it comes back. False when the row moved on."""

    @abc.abstractmethod
    def requeue_unstarted(self, grace: float) -> int:
        """Rows ``sent`` more than :func:`republish_after` seconds ago (``grace`` after their first
        publish, doubling with each copy), due more than ``grace`` ago and never started go back to
        pending with the same token: their message was lost, the sweep publishes them again."""

    @abc.abstractmethod
    def expired_unstarted(self, limit: int) -> list[DelayRow]:
        """Up to ``limit`` rows ``sent`` and not started whose ``expires_at`` has passed by the store's
        clock: their message expires in the broker (or is discarded by the worker that takes it), so
        they never start. Ordered by ``(expires_at, id)``."""

    @abc.abstractmethod
    def end_expired(self, task_id: str, token: str) -> bool:
        """Close a row found by :meth:`expired_unstarted`: still ``sent`` with ``token`` and past its
        ``expires_at`` -> ``expired``. True when it changed (once per row, whoever asks)."""

    @abc.abstractmethod
    def stale_started(self, stale_after: float, limit: int) -> list[DelayRow]:
        """Rows ``started`` whose heartbeat is older than ``stale_after`` seconds (their worker died)."""

    @abc.abstractmethod
    def end_stale(
        self, task_id: str, token: str, stale_after: float, *, rerun: bool, looked_within: float = math.inf
    ) -> bool:
        """A dead started row (see :meth:`start`): back to pending with the same token (``rerun``,
        acks_late tasks) or finished with outcome ``interrupted``; True when it changed. A row only
        found stale gets ``suspected_at`` and False.

        ``looked_within``: each look at a suspected row records itself (``updated_at``); a row last
        looked at more than ``looked_within`` seconds ago is suspected anew instead of taken over.
        The gap means the store (or every sweep) was unreachable meanwhile, and a run's heartbeat
        cannot be written while the store is down: only a silence of ``stale_after`` seconds while the
        store answered shows the run is dead."""

    # --- the sweep -------------------------------------------------------------

    @abc.abstractmethod
    def claim_due(self, *, limit: int, lookahead: float, token: str) -> list[DelayRow]:
        """Claim up to ``limit`` pending rows due by the store's now plus ``lookahead`` seconds.

        Claimed rows get ``status='claimed'``, ``claim_token=token``, ``claimed_at`` = store now
        and one more attempt. Rows come back ordered by ``(due_at, id)``. Concurrent callers
        never get the same row.
        """

    def pending_ahead(self, horizon: datetime, limit: int) -> tuple[int, datetime | None]:
        """How many pending rows are due by ``horizon`` (counting stops at ``limit``), and the due time
        of the last one counted: what the sweep's adaptive look-ahead is sized from."""
        rows = self.list(status=C.STATUS_PENDING, due_before=horizon, limit=limit)
        return len(rows), (rows[-1].due_at if rows else None)

    @abc.abstractmethod
    def _finish(self, task_ids: Sequence[str], token: str, *, status: str, **values: Any) -> int:
        """Claimed rows of claim ``token`` -> ``status``, clearing the claim; ``sent_at=True`` stamps
        the store's now. Returns how many rows changed (rows claimed by someone else are left alone)."""

    def mark_sent(self, task_ids: Sequence[str], token: str) -> int:
        """Claimed rows of this claim -> sent. Returns how many changed."""
        return self._finish(task_ids, token, status=C.STATUS_SENT, sent_at=True)

    def mark_expired(self, task_ids: Sequence[str], token: str) -> int:
        """Claimed rows of this claim -> expired. Returns how many changed."""
        return self._finish(task_ids, token, status=C.STATUS_EXPIRED)

    def mark_failed(self, task_id: str, token: str, error: str) -> bool:
        """A claimed row of this claim -> failed, with the error kept."""
        return self._finish([task_id], token, status=C.STATUS_FAILED, last_error=truncate_error(error)) == 1

    def release(self, task_ids: Sequence[str], token: str) -> int:
        """Claimed rows of this claim go back to pending now (the broker refused them)."""
        return self._finish(task_ids, token, status=C.STATUS_PENDING)

    @abc.abstractmethod
    def reclaim_stale(self, timeout: float) -> int:
        """Claimed rows older than ``timeout`` seconds (store clock) go back to pending."""

    # --- retention -----------------------------------------------------------------

    def purge(
        self,
        before: datetime,
        statuses: Collection[str] = C.PURGE_DEFAULT_STATUSES,
        limit: int = C.PURGE_BATCH,
    ) -> int:
        """Delete up to ``limit`` rows in ``statuses`` last changed before ``before``; returns how many.

        ``before`` is an aware datetime compared with ``updated_at`` (the store's clock stamped it).
        Pending and claimed rows are never deleted: asking for them raises
        :class:`~celery_safe_time.exceptions.PurgeRefused` (a ``ValueError``). One short transaction
        per call; callers loop while the count equals ``limit``.
        """
        wanted = check_purge(before, statuses, limit)
        if not wanted:
            return 0
        return self._purge(before, wanted, limit)

    def purgeable(self, before: datetime, statuses: Collection[str] = C.PURGE_DEFAULT_STATUSES) -> int:
        """How many rows :meth:`purge` would delete with no limit (``delays purge --dry-run``)."""
        wanted = check_purge(before, statuses, 1)
        if not wanted:
            return 0
        return self._purgeable(before, wanted)

    @abc.abstractmethod
    def _purgeable(self, before: datetime, statuses: frozenset[str]) -> int:
        """Count rows of ``statuses`` with ``updated_at < before`` (arguments checked)."""

    @abc.abstractmethod
    def _purge(self, before: datetime, statuses: frozenset[str], limit: int) -> int:
        """Delete up to ``limit`` rows of ``statuses`` with ``updated_at < before`` (arguments checked)."""

    # --- reads -------------------------------------------------------------------

    @abc.abstractmethod
    def get(self, task_id: str) -> DelayRow | None:
        """One row by task id, or None."""

    @abc.abstractmethod
    def _list(self, status: str | None, task: str | None, due_before: datetime | None, limit: int) -> list[DelayRow]:
        """The backend's own :meth:`list`."""

    def list(
        self,
        *,
        status: str | None = None,
        task: str | None = None,
        due_before: datetime | None = None,
        limit: int = 100,
    ) -> list[DelayRow]:
        """Rows ordered by ``(due_at, id)``, filtered."""
        return self._list(status, task, due_before, limit)

    @abc.abstractmethod
    def counts(self) -> dict[str, int]:
        """Number of rows per status (every status present, zero included)."""

    @abc.abstractmethod
    def oldest_due(self, status: str = C.STATUS_PENDING) -> datetime | None:
        """The smallest ``due_at`` among rows with ``status``."""

    def pending_debounced(self) -> int:
        """How many pending rows are debounced bursts (their idempotency key starts ``debounce:``).

        This default reads at most ``C.DEBOUNCE_COUNT_LIMIT`` pending rows; the stores count in one query.
        """
        rows = self.list(status=C.STATUS_PENDING, limit=C.DEBOUNCE_COUNT_LIMIT)
        return sum(1 for r in rows if (r.idempotency_key or "").startswith(C.DEBOUNCE_KEY_PREFIX))


def debounced_values(delay: NewDelay, now: datetime, debounce_until: datetime | None) -> dict[str, Any]:
    """The columns a later call of a burst replaces in the pending row (every backend)."""
    due_at, expires_at = delay.resolve(now)
    return {
        "payload": delay.payload,
        "content_type": delay.content_type,
        "content_encoding": delay.content_encoding,
        # Now plus the period, never past the burst's cap.
        "due_at": due_at if debounce_until is None else min(due_at, debounce_until),
        "expires_at": expires_at,
        # A copy published earlier (a claim reclaimed after its sweep died) carries the old arguments:
        # the delivery check drops it as superseded.
        "delivery_token": new_delivery_token(),
        "updated_at": now,
    }


def check_purge(before: datetime, statuses: Collection[str], limit: int) -> frozenset[str]:
    """Validate :meth:`DelayStore.purge` arguments; returns the statuses as a set."""
    if isinstance(statuses, str):
        # A bare "sent" would otherwise be read as the letters s, e, n, t.
        statuses = [statuses]
    wanted = frozenset(statuses)
    unfinished = wanted - C.PURGEABLE_STATUSES
    if unfinished:
        raise PurgeRefused(
            f"purge only deletes finished rows ({', '.join(sorted(C.PURGEABLE_STATUSES))}), "
            f"not {', '.join(sorted(unfinished))}"
        )
    if before.tzinfo is None or before.utcoffset() is None:
        raise PurgeRefused(f"purge needs an aware datetime, got naive {before!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise PurgeRefused(f"purge limit must be a positive integer, got {limit!r}")
    return wanted


def refused(index: int, message: str) -> StoreError:
    """The error of delay ``index`` of an ``insert_many`` batch."""
    error = StoreError(f"delay {index} of the batch: {message}")
    error.index = index
    return error


def truncate_error(error: str) -> str:
    """Keep stored error messages within the column size."""
    if len(error) <= C.DELAY_ERROR_LENGTH:
        return error
    return error[: C.DELAY_ERROR_LENGTH - 3] + "..."


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(C.DELAY_STATUSES, 0)
