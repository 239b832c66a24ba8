"""The Django ORM store (``safe_time_store_url = "django"``): the contrib app's model, same contract."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import DataError, IntegrityError, InterfaceError, connections, transaction
from django.db import Error as DjangoDbError
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce

from ... import constants as C
from ...clock import as_utc
from ...delays.backends.base import (
    NOW_SQL,
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
    rerun_values,
    start_verdict,
    started_values,
    truncate_error,
)
from ...exceptions import StoreError

T = TypeVar("T")


def _row(obj: Any) -> DelayRow:
    return DelayRow.from_mapping(vars(obj))


def _stale_heartbeat(now: datetime, stale_after: float) -> Q:
    return Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=now - timedelta(seconds=stale_after))


def _suspect(now: datetime, stale_after: float) -> Q:
    """Started, heartbeat stale, not suspected since its last heartbeat (see ``DelayRow.suspected_at``)."""
    fresh_suspicion = Q(suspected_at__isnull=True) | Q(heartbeat_at__gt=F("suspected_at"))
    return Q(status=C.STATUS_STARTED) & _stale_heartbeat(now, stale_after) & fresh_suspicion


def _dead(now: datetime, stale_after: float) -> Q:
    """Suspected more than ``stale_after`` ago, with no heartbeat since."""
    quiet = Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lte=F("suspected_at"))
    return Q(status=C.STATUS_STARTED, suspected_at__lt=now - timedelta(seconds=stale_after)) & quiet


def _looked_away(now: datetime, looked_within: float) -> Q:
    """Suspected, no heartbeat since, and not looked at for ``looked_within`` seconds: the store (or
    every sweep) was out of reach meanwhile, so the suspicion starts over."""
    if not math.isfinite(looked_within):
        return Q(pk__in=[])
    quiet = Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lte=F("suspected_at"))
    return (
        Q(status=C.STATUS_STARTED, suspected_at__isnull=False)
        & quiet
        & Q(updated_at__lt=now - timedelta(seconds=looked_within))
    )


class DjangoStore(DelayStore):
    """Rows in the ``celery_safe_time`` app's table through the ORM, on database alias ``using``."""

    def __init__(self, using: str = "default") -> None:
        self.using = using
        self.url = C.DJANGO_STORE

    @property
    def model(self) -> Any:
        from .models import DelayedTask

        return DelayedTask

    def _objects(self) -> Any:
        """Rows of this store's namespace and legacy ones (every row for a store without one)."""
        objects = self.model.objects.using(self.using)
        scope = self.scope
        return objects.all() if scope is None else objects.filter(namespace__in=scope)

    def _all_objects(self) -> Any:
        """Every row, whatever its namespace: task ids are unique across the table."""
        return self.model.objects.using(self.using)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        # django.db.Error, not only DatabaseError: InterfaceError ("connection already closed" after a
        # database restart) is its sibling, and callers (the sweep's mark_sent retry) retry StoreError.
        try:
            yield
        except DjangoDbError as exc:
            self._drop_broken_connection(exc)
            raise StoreError(f"django store ({self.using}): {exc.__class__.__name__}: {exc}") from exc

    def _drop_broken_connection(self, exc: DjangoDbError) -> None:
        """Close a connection the error left unusable, so the next call (a retry) reconnects.

        Django reconnects only when it has no connection: a dead one is reused until closed, and
        ``atomic()`` closes it only when the failure happened inside the block. Statement-level
        errors leave the connection fine; inside the caller's own transaction Django's ``atomic``
        exit deals with it (closing there would break the caller's block).
        """
        if isinstance(exc, (DataError, IntegrityError)):
            return
        connection = connections[self.using]
        if connection.in_atomic_block:
            return
        try:
            if isinstance(exc, InterfaceError):
                connection.close()  # a connection-level error by definition ("connection already closed")
            else:
                # one "SELECT 1" when an error occurred; closes the connection if that fails too
                connection.close_if_unusable_or_obsolete()
        except DjangoDbError:
            # close() forgets the connection even when closing it fails (it is dead anyway)
            with suppress(DjangoDbError):
                connection.close()

    def _atomic(self, fn: Callable[[], T]) -> T:
        with self._errors(), transaction.atomic(using=self.using):
            return fn()

    def now(self) -> datetime:
        connection = connections[self.using]
        with self._errors(), connection.cursor() as cursor:
            cursor.execute(NOW_SQL.get(connection.vendor, NOW_SQL["mysql"]))
            return as_utc(cursor.fetchone()[0])

    def ping(self) -> None:
        self.now()

    def close(self) -> None:
        connections[self.using].close()

    def insert(self, delay: NewDelay) -> InsertResult:
        # Fast path first; a unique violation (task id taken, idempotency key won by a concurrent
        # call) takes the careful path in a new transaction.
        try:
            return self._atomic(lambda: self._insert(delay, careful=False))
        except StoreError as exc:
            if not isinstance(exc.__cause__, IntegrityError):
                raise
        return self._atomic(lambda: self._insert(delay, careful=True))

    def _insert(self, delay: NewDelay, *, careful: bool, held: bool = True) -> InsertResult:
        """``held=False``: the key was just looked up; a row that holds it since is a unique violation."""
        objects = self._objects()
        if held and delay.idempotency_key is not None:
            found = (
                objects.filter(idempotency_key=delay.idempotency_key, status=C.STATUS_PENDING)
                .values_list("id", "due_at")
                .first()
            )
            if found is not None:
                return InsertResult(found[0], created=False, due_at=as_utc(found[1]))
        if careful:
            everyone = self._all_objects()
            existing = everyone.filter(id=delay.id).values_list("status", flat=True).first()
            if existing is not None:
                if existing not in C.DELAY_REPLACEABLE_STATUSES:
                    raise StoreError(f"task id {delay.id!r} is already stored and {existing}")
                everyone.filter(id=delay.id, status__in=list(C.DELAY_REPLACEABLE_STATUSES)).delete()
        values = self.new_row(delay, self.now())
        # force_insert: never an UPDATE of an existing primary key (Django's save() would do that).
        self.model(**values).save(using=self.using, force_insert=True)
        return InsertResult(delay.id, created=True, due_at=values["due_at"])

    def debounce(self, delay: NewDelay) -> InsertResult:
        # As the SQLAlchemy store: the row locked (select_for_update) and moved, or a new row; a
        # concurrent first call that won the key makes this one run its transaction again.
        for attempt in range(C.DEBOUNCE_ATTEMPTS):
            careful = attempt > 0
            try:
                return self._atomic(functools.partial(self._debounce, delay, careful=careful))
            except StoreError as exc:
                if attempt == C.DEBOUNCE_ATTEMPTS - 1 or not isinstance(exc.__cause__, IntegrityError):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _debounce(self, delay: NewDelay, *, careful: bool) -> InsertResult:
        # As the SQLAlchemy store: found by its key, then locked by its primary key only (the order
        # the sweep's claim locks in).
        pending = (
            self._objects()
            .filter(idempotency_key=delay.idempotency_key, status=C.STATUS_PENDING)
            .values_list("id", flat=True)
            .first()
        )
        found = None
        if pending is not None:
            found = (
                self._all_objects()
                .select_for_update()
                .filter(id=pending, status=C.STATUS_PENDING)
                .values_list("id", "debounce_until")
                .first()
            )
        if found is None:
            return self._insert(delay, careful=careful, held=False)
        values = debounced_values(delay, self.now(), None if found[1] is None else as_utc(found[1]))
        if self._all_objects().filter(id=found[0], status=C.STATUS_PENDING).update(**values):
            return InsertResult(found[0], created=False, due_at=values["due_at"])
        # SQLite takes no row lock: a claim in between left nothing to move, a new burst starts.
        return self._insert(delay, careful=careful, held=False)

    def insert_many(self, delays: Sequence[NewDelay]) -> list[InsertResult]:
        if not delays:
            return []
        # As the SQLAlchemy store: a fast path (keys in a few queries, bulk_create), and on a unique
        # violation the careful path row by row, each in one transaction.
        try:
            return self._atomic(lambda: self._insert_many_fast(delays))
        except StoreError as exc:
            if not isinstance(exc.__cause__, IntegrityError):
                raise

        def careful() -> list[InsertResult]:
            results: list[InsertResult] = []
            for index, delay in enumerate(delays):
                try:
                    results.append(self._insert(delay, careful=True))
                except StoreError as exc:
                    raise refused(index, str(exc)) from exc
            return results

        return self._atomic(careful)

    def _insert_many_fast(self, batch: Sequence[NewDelay]) -> list[InsertResult]:
        objects = self._objects()
        held: dict[str, tuple[str, datetime]] = {}
        keys = sorted({d.idempotency_key for d in batch if d.idempotency_key is not None})
        for start in range(0, len(keys), C.BULK_KEY_LOOKUP):
            chunk = keys[start : start + C.BULK_KEY_LOOKUP]
            found = objects.filter(idempotency_key__in=chunk, status=C.STATUS_PENDING)
            for key, task_id, due_at in found.values_list("idempotency_key", "id", "due_at"):
                held[key] = (task_id, as_utc(due_at))
        now = self.now()
        results: list[InsertResult] = []
        rows: list[Any] = []
        for delay in batch:
            key = delay.idempotency_key
            if key is not None and key in held:
                results.append(InsertResult(held[key][0], created=False, due_at=held[key][1]))
                continue
            values = self.new_row(delay, now)
            rows.append(self.model(**values))
            if key is not None:
                held[key] = (delay.id, values["due_at"])
            results.append(InsertResult(delay.id, created=True, due_at=values["due_at"]))
        objects.bulk_create(rows, batch_size=C.BULK_INSERT_CHUNK)
        return results

    def _update_unstarted(self, task_id: str, **values: Any) -> bool:
        def run() -> bool:
            changed = (
                self._objects()
                .filter(id=task_id, status__in=sorted(C.DELAY_CANCELLABLE_STATUSES))
                .update(updated_at=self.now(), claim_token=None, **values)
            )
            return bool(changed)

        return self._atomic(run)

    def cancel(self, task_id: str) -> bool:
        return self._update_unstarted(task_id, status=C.STATUS_CANCELLED)

    def reschedule(self, task_id: str, due_at: datetime) -> bool:
        return self._update_unstarted(
            task_id, due_at=due_at, status=C.STATUS_PENDING, delivery_token=new_delivery_token()
        )

    def rerun(self, task_id: str) -> bool:
        def run() -> bool:
            now = self.now()
            changed = (
                self._objects()
                .filter(id=task_id, status__in=sorted(C.DELAY_RERUNNABLE_STATUSES))
                .update(**rerun_values(now), updated_at=now)
            )
            return bool(changed)

        return self._atomic(run)

    # --- the delivery record ---------------------------------------------------------

    def _start(
        self, task_id: str, token: str, run_id: str, worker: str, stale: float, prior: Sequence[str], leeway: float
    ) -> StartResult:
        def run() -> StartResult:
            now = self.now()
            taken_over = _dead(now, stale)
            if prior:
                taken_over |= Q(started_by__in=list(prior))
            unstarted = Q(status__in=sorted(C.DELAY_STARTABLE_STATUSES))
            if math.isfinite(leeway):
                unstarted &= Q(due_at__lte=now + timedelta(seconds=leeway))
            startable = unstarted | (Q(status=C.STATUS_STARTED) & taken_over)
            objects = self._all_objects()
            mine = objects.filter(id=task_id, delivery_token=token)
            won = mine.filter(startable).update(
                **started_values(now, worker[: C.DELIVERY_WORKER_LENGTH], run_id),
                starts=F("starts") + 1,
                updated_at=now,
            )
            if won:
                return StartResult("run")
            mine.filter(_suspect(now, stale)).update(suspected_at=now)
            obj = objects.filter(id=task_id).first()
            row = None if obj is None else _row(obj)
            early = early_by(row, now, leeway)
            return StartResult(start_verdict(row, token, early), row, early)

        return self._atomic(run)

    def _running(self, task_id: str, token: str, run_id: str) -> Any:
        return self._all_objects().filter(id=task_id, delivery_token=token, status=C.STATUS_STARTED, started_by=run_id)

    def heartbeat(self, task_id: str, token: str, run_id: str) -> bool:
        return self._atomic(lambda: bool(self._running(task_id, token, run_id).update(heartbeat_at=self.now())))

    def finish(
        self, task_id: str, token: str, run_id: str, outcome: str, error: str | None = None, *, durable: bool = True
    ) -> bool:
        values: dict[str, Any] = {"status": C.STATUS_FINISHED, "outcome": outcome}
        if error is not None:
            values["last_error"] = truncate_error(error)

        def run() -> bool:
            now = self.now()
            return bool(self._running(task_id, token, run_id).update(finished_at=now, updated_at=now, **values))

        return self._atomic(run)

    def hand_back(self, task_id: str, token: str, run_id: str) -> bool:
        def run() -> bool:
            now = self.now()
            values = {"status": C.STATUS_SENT, "sent_at": now, "suspected_at": None, "updated_at": now}
            return bool(self._running(task_id, token, run_id).update(**values))

        return self._atomic(run)

    def requeue_unstarted(self, grace: float) -> int:
        def run() -> int:
            now = self.now()
            cutoff = now - timedelta(seconds=grace)
            return int(
                self._objects()
                .filter(status=C.STATUS_SENT, sent_at__lt=cutoff, due_at__lt=cutoff)
                .update(status=C.STATUS_PENDING, updated_at=now)
            )

        return self._atomic(run)

    def expired_unstarted(self, limit: int) -> list[DelayRow]:
        with self._errors():
            expired = self._objects().filter(status=C.STATUS_SENT, expires_at__lt=self.now())
            return [_row(o) for o in expired.order_by("expires_at", "id")[:limit]]

    def end_expired(self, task_id: str, token: str) -> bool:
        def run() -> bool:
            now = self.now()
            changed = (
                self._objects()
                .filter(id=task_id, status=C.STATUS_SENT, delivery_token=token, expires_at__lt=now)
                .update(status=C.STATUS_EXPIRED, updated_at=now)
            )
            return bool(changed)

        return self._atomic(run)

    def stale_started(self, stale_after: float, limit: int) -> list[DelayRow]:
        with self._errors():
            stale = self._objects().filter(_stale_heartbeat(self.now(), stale_after), status=C.STATUS_STARTED)
            return [_row(o) for o in stale.order_by("heartbeat_at", "id")[:limit]]

    def end_stale(
        self, task_id: str, token: str, stale_after: float, *, rerun: bool, looked_within: float = math.inf
    ) -> bool:
        def run() -> bool:
            now = self.now()
            values: dict[str, Any] = (
                {"status": C.STATUS_PENDING, "suspected_at": None}
                if rerun
                else {"status": C.STATUS_FINISHED, "outcome": C.OUTCOME_INTERRUPTED, "finished_at": now}
            )
            mine = self._all_objects().filter(id=task_id, delivery_token=token)
            away = _looked_away(now, looked_within)
            if mine.filter(_dead(now, stale_after)).exclude(away).update(updated_at=now, **values):
                return True
            if mine.filter(_suspect(now, stale_after) | away).update(suspected_at=now, updated_at=now):
                return False
            # Still suspected: this look is recorded (updated_at), so the next one knows the store answered.
            mine.filter(status=C.STATUS_STARTED, suspected_at__isnull=False).update(updated_at=now)
            return False

        return self._atomic(run)

    def claim_due(self, *, limit: int, lookahead: float, token: str) -> list[DelayRow]:
        def run() -> list[DelayRow]:
            now = self.now()
            objects = self._objects()
            picked = objects.filter(status=C.STATUS_PENDING, due_at__lte=now + timedelta(seconds=lookahead))
            if connections[self.using].features.has_select_for_update_skip_locked:
                picked = picked.select_for_update(skip_locked=True)
            ids = list(picked.order_by("due_at", "id").values_list("id", flat=True)[:limit])
            if not ids:
                return []
            objects.filter(id__in=ids).update(
                status=C.STATUS_CLAIMED,
                claim_token=token,
                claimed_at=now,
                updated_at=now,
                attempts=F("attempts") + 1,
                # Rows stored before the delivery record get a token now (unique with the row's id).
                delivery_token=Coalesce(F("delivery_token"), Value(token)),
            )
            return [_row(o) for o in objects.filter(id__in=ids).order_by("due_at", "id")]

        return self._atomic(run)

    def pending_ahead(self, horizon: datetime, limit: int) -> tuple[int, datetime | None]:
        with self._errors():
            dues = list(
                self._objects()
                .filter(status=C.STATUS_PENDING, due_at__lte=horizon)
                .order_by("due_at", "id")
                .values_list("due_at", flat=True)[:limit]
            )
        return len(dues), (as_utc(dues[-1]) if dues else None)

    def _finish(self, task_ids: Sequence[str], token: str, *, status: str, **values: Any) -> int:
        if not task_ids:
            return 0

        def run() -> int:
            now = self.now()
            if values.get("sent_at") is True:
                values["sent_at"] = now
            return int(
                self._all_objects()
                .filter(id__in=list(task_ids), status=C.STATUS_CLAIMED, claim_token=token)
                .update(claim_token=None, updated_at=now, status=status, **values)
            )

        return self._atomic(run)

    def reclaim_stale(self, timeout: float) -> int:
        def run() -> int:
            now = self.now()
            return int(
                self._objects()
                .filter(status=C.STATUS_CLAIMED, claimed_at__lt=now - timedelta(seconds=timeout))
                .update(status=C.STATUS_PENDING, claim_token=None, updated_at=now)
            )

        return self._atomic(run)

    def _older(self, before: datetime, statuses: frozenset[str]) -> Any:
        return self._objects().filter(status__in=sorted(statuses), updated_at__lt=before)

    def _purgeable(self, before: datetime, statuses: frozenset[str]) -> int:
        with self._errors():
            return int(self._older(before, statuses).count())

    def _purge(self, before: datetime, statuses: frozenset[str], limit: int) -> int:
        def run() -> int:
            old = self._older(before, statuses)
            # Ids first, as a list: MySQL refuses LIMIT inside an IN (subquery).
            ids = list(old.values_list("id", flat=True)[:limit])
            if not ids:
                return 0
            # The filter repeats age and status: a row replaced meanwhile must not go.
            deleted, _ = old.filter(id__in=ids).delete()
            return int(deleted)

        return self._atomic(run)

    def get(self, task_id: str) -> DelayRow | None:
        with self._errors():
            obj = self._objects().filter(id=task_id).first()
        return None if obj is None else _row(obj)

    def _list(self, status: str | None, task: str | None, due_before: datetime | None, limit: int) -> list[DelayRow]:
        query = self._objects().all()
        if status is not None:
            query = query.filter(status=status)
        if task is not None:
            query = query.filter(task=task)
        if due_before is not None:
            query = query.filter(due_at__lte=due_before)
        with self._errors():
            return [_row(o) for o in query.order_by("due_at", "id")[:limit]]

    def counts(self) -> dict[str, int]:
        from django.db.models import Count

        counts = empty_counts()
        with self._errors():
            for item in self._objects().order_by().values("status").annotate(n=Count("id")):
                counts[item["status"]] = int(item["n"])
        return counts

    def pending_debounced(self) -> int:
        with self._errors():
            found = self._objects().filter(status=C.STATUS_PENDING, idempotency_key__startswith=C.DEBOUNCE_KEY_PREFIX)
            return int(found.count())

    def oldest_due(self, status: str = C.STATUS_PENDING) -> datetime | None:
        from django.db.models import Min

        with self._errors():
            value = self._objects().filter(status=status).aggregate(oldest=Min("due_at"))["oldest"]
        return None if value is None else as_utc(value)
