"""In-memory store for unit tests and examples: same contract, nothing durable."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from ... import constants as C
from ...clock import local_time, to_datetime
from ...exceptions import StoreError
from .base import (
    DelayRow,
    DelayStore,
    InsertResult,
    NewDelay,
    StartResult,
    debounced_values,
    early_by,
    empty_counts,
    new_delivery_token,
    refused,
    republish_after,
    rerun_values,
    start_verdict,
    started_values,
    truncate_error,
)


class MemoryStore(DelayStore):
    """Keeps rows in a dict guarded by a lock; its clock is the local clock."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._lock = threading.RLock()
        self._rows: dict[str, DelayRow] = {}

    def now(self) -> datetime:
        return to_datetime(local_time())

    def ping(self) -> None:
        return None

    def _mine(self, row: DelayRow | None) -> bool:
        scope = self.scope
        return row is not None and (scope is None or row.namespace in scope)

    def _scoped(self) -> list[DelayRow]:
        return [r for r in self._rows.values() if self._mine(r)]

    def _replace(self, row: DelayRow, **changes: object) -> DelayRow:
        new = dataclasses.replace(row, updated_at=self.now(), **changes)  # type: ignore[arg-type]
        self._rows[row.id] = new
        return new

    def insert(self, delay: NewDelay) -> InsertResult:
        with self._lock:
            if delay.idempotency_key is not None:
                for row in self._scoped():
                    if row.status == C.STATUS_PENDING and row.idempotency_key == delay.idempotency_key:
                        return InsertResult(row.id, created=False, due_at=row.due_at)
            existing = self._rows.get(delay.id)
            if existing is not None and existing.status not in C.DELAY_REPLACEABLE_STATUSES:
                raise StoreError(f"task id {delay.id!r} is already stored and {existing.status}")
            values = self.new_row(delay, self.now())
            self._rows[delay.id] = DelayRow(**values)
            return InsertResult(delay.id, created=True, due_at=values["due_at"])

    def debounce(self, delay: NewDelay) -> InsertResult:
        with self._lock:
            for row in self._scoped():
                if row.status == C.STATUS_PENDING and row.idempotency_key == delay.idempotency_key:
                    values = debounced_values(delay, self.now(), row.debounce_until)
                    self._rows[row.id] = dataclasses.replace(row, **values)
                    return InsertResult(row.id, created=False, due_at=values["due_at"])
            return self.insert(delay)

    def insert_many(self, delays: Sequence[NewDelay]) -> list[InsertResult]:
        with self._lock:
            before = dict(self._rows)
            results: list[InsertResult] = []
            try:
                for index, delay in enumerate(delays):
                    try:
                        results.append(self.insert(delay))
                    except StoreError as exc:
                        raise refused(index, str(exc)) from exc
            except BaseException:
                self._rows = before
                raise
            return results

    def _change(self, task_id: str, statuses: frozenset[str], **changes: Any) -> bool:
        """Apply ``changes`` to row ``task_id`` of this namespace if it is in one of ``statuses``."""
        with self._lock:
            row = self._rows.get(task_id)
            if row is None or not self._mine(row) or row.status not in statuses:
                return False
            self._replace(row, **changes)
            return True

    def cancel(self, task_id: str) -> bool:
        return self._change(task_id, C.DELAY_CANCELLABLE_STATUSES, status=C.STATUS_CANCELLED, claim_token=None)

    def reschedule(self, task_id: str, due_at: datetime) -> bool:
        changes = {"due_at": due_at, "status": C.STATUS_PENDING, "claim_token": None}
        return self._change(task_id, C.DELAY_CANCELLABLE_STATUSES, **changes, delivery_token=new_delivery_token())

    def rerun(self, task_id: str) -> bool:
        return self._change(task_id, C.DELAY_RERUNNABLE_STATUSES, **rerun_values(self.now()))

    def _start(
        self, task_id: str, token: str, run_id: str, worker: str, stale: float, prior: Sequence[str], leeway: float
    ) -> StartResult:
        with self._lock:
            now = self.now()
            row = self._rows.get(task_id)
            early = early_by(row, now, leeway)
            mine = row is not None and row.delivery_token == token
            if row is not None and mine and not early and _startable(row, now, stale, prior):
                started = self._replace(row, **started_values(now, worker, run_id), starts=row.starts + 1)
                return StartResult("run", started)
            if row is not None and mine and _suspect(row, now, stale):
                row = self._replace(row, suspected_at=now)
            return StartResult(start_verdict(row, token, early), row, early)

    def _write_run(self, task_id: str, token: str, run_id: str, **changes: Any) -> bool:
        """Apply ``changes`` to row ``task_id`` while ``run_id`` runs its delivery ``token``."""
        with self._lock:
            row = self._rows.get(task_id)
            if row is None or row.status != C.STATUS_STARTED or row.delivery_token != token:
                return False
            if row.started_by != run_id:
                return False
            self._replace(row, **changes)
            return True

    def heartbeat(self, task_id: str, token: str, run_id: str) -> bool:
        return self._write_run(task_id, token, run_id, heartbeat_at=self.now())

    def finish(
        self, task_id: str, token: str, run_id: str, outcome: str, error: str | None = None, *, durable: bool = True
    ) -> bool:
        kept = {} if error is None else {"last_error": truncate_error(error)}
        ended = {"status": C.STATUS_FINISHED, "outcome": outcome, "finished_at": self.now()}
        return self._write_run(task_id, token, run_id, **ended, **kept)

    def hand_back(self, task_id: str, token: str, run_id: str) -> bool:
        return self._write_run(task_id, token, run_id, status=C.STATUS_SENT, sent_at=self.now(), suspected_at=None)

    def requeue_unstarted(self, grace: float) -> int:
        def waited(row: DelayRow, now: datetime) -> bool:
            sent_before = now - timedelta(seconds=republish_after(grace, row.attempts))
            return (row.sent_at or now) < sent_before and row.due_at < now - timedelta(seconds=grace)

        return self._back_to_pending(C.STATUS_SENT, waited)

    def _back_to_pending(self, status: str, waited: Callable[[DelayRow, datetime], bool], **changes: Any) -> int:
        """Rows in ``status`` that ``waited(row, now)`` long enough go back to pending."""
        with self._lock:
            now = self.now()
            old = [r for r in self._scoped() if r.status == status and waited(r, now)]
            for row in old:
                self._replace(row, status=C.STATUS_PENDING, **changes)
            return len(old)

    def expired_unstarted(self, limit: int) -> list[DelayRow]:
        with self._lock:
            now = self.now()
            expired = [r for r in self._scoped() if r.status == C.STATUS_SENT and _expired(r, now)]
        return sorted(expired, key=lambda r: (r.expires_at, r.id))[:limit]

    def end_expired(self, task_id: str, token: str) -> bool:
        with self._lock:
            row = self._rows.get(task_id)
            if row is None or not self._mine(row) or row.status != C.STATUS_SENT or row.delivery_token != token:
                return False
            if not _expired(row, self.now()):
                return False
            self._replace(row, status=C.STATUS_EXPIRED)
            return True

    def stale_started(self, stale_after: float, limit: int) -> list[DelayRow]:
        with self._lock:
            cutoff = self.now() - timedelta(seconds=stale_after)
            stale = [r for r in self._scoped() if r.status == C.STATUS_STARTED and _heartbeat_before(r, cutoff)]
        return sorted(stale, key=lambda r: (r.heartbeat_at or r.updated_at, r.id))[:limit]

    def end_stale(
        self, task_id: str, token: str, stale_after: float, *, rerun: bool, looked_within: float = math.inf
    ) -> bool:
        with self._lock:
            row = self._rows.get(task_id)
            now = self.now()
            if row is None or row.status != C.STATUS_STARTED or row.delivery_token != token:
                return False
            away = _looked_away(row, now, looked_within)
            if away or not _dead(row, now, stale_after):
                if away or _suspect(row, now, stale_after):
                    self._replace(row, suspected_at=now)
                elif row.suspected_at is not None:
                    self._replace(row)  # this look is recorded (updated_at): the store answered
                return False
            if rerun:
                self._replace(row, status=C.STATUS_PENDING, suspected_at=None)
            else:
                self._replace(row, status=C.STATUS_FINISHED, outcome=C.OUTCOME_INTERRUPTED, finished_at=now)
            return True

    def claim_due(self, *, limit: int, lookahead: float, token: str) -> list[DelayRow]:
        with self._lock:
            now = self.now()
            horizon = now + timedelta(seconds=lookahead)
            due = sorted(
                (r for r in self._scoped() if r.status == C.STATUS_PENDING and r.due_at <= horizon),
                key=lambda r: (r.due_at, r.id),
            )[:limit]
            return [
                self._replace(
                    r,
                    status=C.STATUS_CLAIMED,
                    claim_token=token,
                    claimed_at=now,
                    attempts=r.attempts + 1,
                    delivery_token=r.delivery_token or token,
                )
                for r in due
            ]

    def _finish(self, task_ids: Sequence[str], token: str, *, status: str, **changes: Any) -> int:
        if changes.get("sent_at") is True:
            changes["sent_at"] = self.now()
        changed = 0
        with self._lock:
            for task_id in task_ids:
                row = self._rows.get(task_id)
                if row is not None and row.status == C.STATUS_CLAIMED and row.claim_token == token:
                    self._replace(row, status=status, claim_token=None, **changes)
                    changed += 1
        return changed

    def reclaim_stale(self, timeout: float) -> int:
        def waited(row: DelayRow, now: datetime) -> bool:
            return (row.claimed_at or now) < now - timedelta(seconds=timeout)

        return self._back_to_pending(C.STATUS_CLAIMED, waited, claim_token=None)

    def _purgeable(self, before: datetime, statuses: frozenset[str]) -> int:
        with self._lock:
            return sum(1 for r in self._scoped() if r.status in statuses and r.updated_at < before)

    def _purge(self, before: datetime, statuses: frozenset[str], limit: int) -> int:
        with self._lock:
            old = [r.id for r in self._scoped() if r.status in statuses and r.updated_at < before][:limit]
            for task_id in old:
                del self._rows[task_id]
            return len(old)

    def get(self, task_id: str) -> DelayRow | None:
        with self._lock:
            row = self._rows.get(task_id)
            return row if self._mine(row) else None

    def _list(self, status: str | None, task: str | None, due_before: datetime | None, limit: int) -> list[DelayRow]:
        with self._lock:
            rows = [
                r
                for r in self._scoped()
                if (status is None or r.status == status)
                and (task is None or r.task == task)
                and (due_before is None or r.due_at <= due_before)
            ]
        return sorted(rows, key=lambda r: (r.due_at, r.id))[:limit]

    def counts(self) -> dict[str, int]:
        counts = empty_counts()
        with self._lock:
            for row in self._scoped():
                counts[row.status] += 1
        return counts

    def pending_debounced(self) -> int:
        with self._lock:
            return sum(
                1
                for r in self._scoped()
                if r.status == C.STATUS_PENDING and (r.idempotency_key or "").startswith(C.DEBOUNCE_KEY_PREFIX)
            )

    def oldest_due(self, status: str = C.STATUS_PENDING) -> datetime | None:
        with self._lock:
            dues = [r.due_at for r in self._scoped() if r.status == status]
        return min(dues) if dues else None


def _heartbeat_before(row: DelayRow, cutoff: datetime) -> bool:
    return row.heartbeat_at is None or row.heartbeat_at < cutoff


def _suspect(row: DelayRow, now: datetime, stale_after: float) -> bool:
    """Started, its heartbeat stale, and not suspected since its last heartbeat: suspect it now."""
    if row.status != C.STATUS_STARTED or not _heartbeat_before(row, now - timedelta(seconds=stale_after)):
        return False
    return row.suspected_at is None or (row.heartbeat_at is not None and row.heartbeat_at > row.suspected_at)


def _dead(row: DelayRow, now: datetime, stale_after: float) -> bool:
    """Suspected more than ``stale_after`` ago, with no heartbeat since."""
    if row.status != C.STATUS_STARTED or row.suspected_at is None:
        return False
    if row.suspected_at >= now - timedelta(seconds=stale_after):
        return False
    return row.heartbeat_at is None or row.heartbeat_at <= row.suspected_at


def _looked_away(row: DelayRow, now: datetime, looked_within: float) -> bool:
    """Suspected, no heartbeat since, and not looked at for ``looked_within`` seconds: start over."""
    if not math.isfinite(looked_within) or row.status != C.STATUS_STARTED or row.suspected_at is None:
        return False
    if row.heartbeat_at is not None and row.heartbeat_at > row.suspected_at:
        return False
    return row.updated_at < now - timedelta(seconds=looked_within)


def _startable(row: DelayRow, now: datetime, stale_after: float, prior_runs: Sequence[str]) -> bool:
    if row.status in C.DELAY_STARTABLE_STATUSES:
        return True
    if row.status != C.STATUS_STARTED:
        return False
    return (row.started_by is not None and row.started_by in prior_runs) or _dead(row, now, stale_after)


def _expired(row: DelayRow, now: datetime) -> bool:
    return row.expires_at is not None and row.expires_at < now
