"""The delayed-task store seam: what every backend (SQLAlchemy, Django ORM, memory) provides.

A store is a table of delayed tasks keyed by task id. Every "when" it decides (is a row due,
has a claim gone stale) is measured with the store's own clock, :meth:`DelayStore.now`, so
processes with wrong local clocks still agree.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from ... import constants as C
from ...clock import as_utc
from ...exceptions import PurgeRefused

#: The database's current time per SQLAlchemy dialect / Django vendor, read when the statement runs
#: (not at transaction start). MySQL/MariaDB: UTC_TIMESTAMP(6) is UTC with microseconds whatever the
#: session's time_zone (NOW(6) would follow it), and DATETIME columns store what they get, unconverted.
NOW_SQL = {
    "postgresql": "SELECT clock_timestamp()",
    "sqlite": "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')",
    "mysql": "SELECT UTC_TIMESTAMP(6)",
    "mariadb": "SELECT UTC_TIMESTAMP(6)",
}

_ROW_TIMES = ("due_at", "created_at", "updated_at", "expires_at", "claimed_at", "sent_at")


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

    @classmethod
    def from_mapping(cls, values: Mapping[Any, Any]) -> DelayRow:
        """A row from column values as a driver or the ORM returns them (times made aware UTC)."""
        fields = {f.name: values[f.name] for f in dataclasses.fields(cls)}
        fields["payload"] = bytes(fields["payload"])
        for name in _ROW_TIMES:
            if fields[name] is not None:
                fields[name] = as_utc(fields[name])
        return cls(**fields)

    def summary(self) -> dict[str, Any]:
        """Everything but the payload, for listings and the CLI."""
        data = dataclasses.asdict(self)
        data.pop("payload")
        data["payload_bytes"] = len(self.payload)
        return data


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
    def cancel(self, task_id: str) -> bool:
        """Mark a pending row cancelled; True when a pending row changed."""

    @abc.abstractmethod
    def reschedule(self, task_id: str, due_at: datetime) -> bool:
        """Move a pending row's ``due_at``; True when a pending row changed."""

    # --- the sweep -------------------------------------------------------------

    @abc.abstractmethod
    def claim_due(self, *, limit: int, lookahead: float, token: str) -> list[DelayRow]:
        """Claim up to ``limit`` pending rows due by the store's now plus ``lookahead`` seconds.

        Claimed rows get ``status='claimed'``, ``claim_token=token``, ``claimed_at`` = store now
        and one more attempt. Rows come back ordered by ``(due_at, id)``. Concurrent callers
        never get the same row.
        """

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
    def list(
        self,
        *,
        status: str | None = None,
        task: str | None = None,
        due_before: datetime | None = None,
        limit: int = 100,
    ) -> list[DelayRow]:
        """Rows ordered by ``(due_at, id)``, filtered."""

    @abc.abstractmethod
    def counts(self) -> dict[str, int]:
        """Number of rows per status (every status present, zero included)."""

    @abc.abstractmethod
    def oldest_due(self, status: str = C.STATUS_PENDING) -> datetime | None:
        """The smallest ``due_at`` among rows with ``status``."""


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


def truncate_error(error: str) -> str:
    """Keep stored error messages within the column size."""
    if len(error) <= C.DELAY_ERROR_LENGTH:
        return error
    return error[: C.DELAY_ERROR_LENGTH - 3] + "..."


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(C.DELAY_STATUSES, 0)
