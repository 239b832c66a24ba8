"""Test helpers for code that uses celery-safe-time: a pytest plugin, usable without pytest too.

``task_always_eager`` runs everything at once and ignores countdowns, so it bypasses the store: a
test of "remind in 14 days" proves nothing. Here the delays go through the real ``SafeTask`` path
into an in-memory store whose clock the test moves forward:

```python
def test_trial_reminder(safe_time):
    start_trial.delay(user_id=42)
    safe_time.assert_stored(send_reminder, kwargs={"user_id": 42}, due_within=timedelta(days=14, minutes=1))
    ran = safe_time.run_due(advance=timedelta(days=14))
    assert [r.task for r in ran] == [send_reminder.name]
```

What the in-process set-up covers (:func:`safe_time_testing`):

- stored delays: an in-memory store (:class:`TestStore`) with the same contract as the database
  stores and a clock that :meth:`SafeTimeTesting.run_due` moves forward; the delivery record
  (conditional start, outcome) runs as in a worker. ``store="sqlite"`` (or the ``safe_time_sqlite``
  fixture) puts the rows in a temporary SQLite file instead (:class:`TestSQLiteStore`: the SQL store
  of production, its table, payload encoding and claim query, with the same movable clock);
- ``overlap_lock``, ``idempotent``, unique tasks (``SafeTask(unique=...)``), ``rate_limit`` and
  ``concurrency_limit``: :class:`MemoryLockBackend`, the Redis lock scripts' rules in Python
  (token-checked acquire/renew/release, fencing numbers, idempotency markers with their window,
  finished-delivery markers, unique keys by task id, the rate limit's sliding log). Rate-limit
  windows follow the test clock; :meth:`SafeTimeTesting.deliver` runs a call as a worker does, and
  :meth:`SafeTimeTesting.assert_rate_limited` says which calls a limit delayed. Not covered: the
  hard-time-limit release (it reads Redis);
- no Redis, no database and no broker, whatever the app's production settings: the block unsets
  ``safe_time_coordination_url``, gives the app a ``memory://`` broker and a ``cache+memory://``
  result backend, and a placeholder ``safe_time_redis_url`` that names itself if anything still
  reaches for Redis (``SafeScheduler`` does: beat needs Redis; test schedules with :func:`next_fires`).

Production validation is unchanged outside the block: a real app without ``safe_time_redis_url``,
with a non-Redis broker and no ``safe_time_coordination_url`` still fails at startup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from billiard.einfo import ExceptionWithTraceback
from celery import Celery, Task
from celery.app.trace import build_tracer

from . import constants as C
from . import signals
from .clock import as_utc, local_time, to_datetime
from .config import SafeTimeConfig, get_config, reset_config
from .delays.backends import reset_store, set_store
from .delays.backends.base import DelayRow
from .delays.backends.memory import MemoryStore
from .delays.backends.sql import SQLAlchemyStore
from .delays.payload import decode
from .delays.revoked import REASON_EXPIRED, report_revoked
from .install_check import sweep_not_needed
from .locks.backends import LockInfo, use_lock_backend
from .locks.backends.memory import MemoryLockBackend
from .messages.requeue import new_attempt

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: The stores a test can ask for (``safe_time_testing(store=...)``).
TestStoreKind = Literal["memory", "sqlite"]

__all__ = [
    "LimitedCall",
    "MemoryLockBackend",
    "RunResult",
    "SafeTimeTesting",
    "StoredDelay",
    "TestSQLiteStore",
    "TestStore",
    "assert_idempotent_done",
    "assert_lock_free",
    "assert_lock_held",
    "assert_not_rate_limited",
    "assert_rate_limited",
    "assert_stored",
    "assert_unique_free",
    "assert_unique_held",
    "deliver",
    "next_fires",
    "run_due",
    "safe_time_testing",
    "stored_delays",
]

UTC = timezone.utc

#: ``safe_time_redis_url`` of a testing app: a socket that cannot exist, named so that the error of
#: anything that still tries Redis (beat, ``safe-time check``) says why.
NO_REDIS_URL = "unix:///nonexistent/celery-safe-time-testing-has-no-redis.sock"

#: run_due stops after this many runs: a task that stores itself again with no delay would loop.
MAX_RUNS = 10_000

_HOST = socket.gethostname()


# --- the in-process backends ---------------------------------------------------------------------


class _MovableClock:
    """The forward-only test clock both test stores share: the store's own clock plus ``offset``,
    held still while the kit runs a call (:meth:`held`)."""

    offset: float = 0.0
    #: While held: the clock's reading (epoch seconds), which real time does not move.
    _held_at: float | None = None
    _holds: int = 0

    if TYPE_CHECKING:  # the store's own clock plus ``offset``; the mixin must not shadow it at runtime

        def now(self) -> datetime: ...

    def _own_time(self) -> float:
        """The store's own clock (epoch seconds), without the offset."""
        raise NotImplementedError

    def time(self) -> float:
        """The test clock as epoch seconds: the rate-limit windows' clock."""
        held = self._held_at
        return held if held is not None else local_time() + self.offset

    def _moved_now(self, own: datetime) -> datetime:
        """``now()`` of a store whose own clock reads ``own``: the held reading while held."""
        held = self._held_at
        return to_datetime(held) if held is not None else own + timedelta(seconds=self.offset)

    def advance(self, delta: timedelta | float) -> datetime:
        """Move the clock ``delta`` forward; returns the new now."""
        seconds = delta.total_seconds() if isinstance(delta, timedelta) else float(delta)
        if seconds < 0:
            raise ValueError(f"the test clock only moves forward, got {delta!r}")
        if self._held_at is not None:
            self._held_at += seconds
        else:
            self.offset += seconds
        return self.now()

    def advance_to(self, when: datetime) -> datetime:
        """Move the clock to ``when`` if that is later than now."""
        if self._held_at is not None:
            # Exactly ``when``: a due row is claimed at its due instant, not a rounding before it.
            self._held_at = max(self._held_at, as_utc(when).timestamp())
            return self.now()
        gap = (as_utc(when) - self.now()).total_seconds()
        if gap > 0:
            self.offset += gap
        return self.now()

    @contextlib.contextmanager
    def held(self) -> Iterator[datetime]:
        """Hold the clock still for the block: only ``advance``/``advance_to`` move it, not real time.

        The kit runs every call in such a block, so a call happens at one instant of the test clock
        (its due time, or the instant ``deliver`` was called) however long the machine takes to run
        it: what a rate limit decides, and the due time of what the call stores, are the same on a
        loaded machine as on an idle one. After the block the clock runs on from where it stood.
        """
        if self._holds == 0:
            self._held_at = self.now().timestamp()
        self._holds += 1
        try:
            yield self.now()
        finally:
            self._holds -= 1
            if self._holds == 0 and self._held_at is not None:
                self.offset = self._held_at - self._own_time()
                self._held_at = None


class TestStore(_MovableClock, MemoryStore):
    """The memory store with a clock a test moves forward (``advance``); it never moves back."""

    __test__ = False  # not a pytest test class

    def __init__(self, url: str = "memory://testing") -> None:
        super().__init__(url)
        self.offset = 0.0

    def _own_time(self) -> float:
        return local_time()

    def now(self) -> datetime:
        return self._moved_now(to_datetime(local_time()))

    def rows(self) -> list[DelayRow]:
        with self._lock:
            return sorted(self._rows.values(), key=lambda r: (r.due_at, r.id))


class TestSQLiteStore(_MovableClock, SQLAlchemyStore):
    """The SQL store on a temporary SQLite file, with a clock a test moves forward (``advance``).

    Every "now" of the store (claims, the delivery record's start and end, ``requeue_unstarted``) is
    SQLite's clock plus the offset, so due rows are found by the production claim query. ``close``
    deletes the file.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or tempfile.mkdtemp(prefix="safe-time-testing-")
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        super().__init__(f"sqlite:///{Path(self.directory) / 'delays.sqlite3'}")
        self.offset = 0.0

    def _own_time(self) -> float:
        return super().now().timestamp()

    def now(self) -> datetime:
        return self._moved_now(super().now())

    def _db_now(self, conn: Connection) -> datetime:
        return self._moved_now(super()._db_now(conn))

    def rows(self) -> list[DelayRow]:
        return self.list(limit=1_000_000)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


# --- what a test reads ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoredDelay:
    """One stored call, decoded: what ``assert_stored`` compares."""

    id: str
    task: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    due_at: datetime
    status: str
    idempotency_key: str | None
    row: DelayRow


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One stored delay that :func:`run_due` ran (or tried to)."""

    id: str
    task: str
    due_at: datetime
    #: Celery's state of the run: SUCCESS, FAILURE, RETRY, IGNORED ...; EXPIRED or FAILED (unpublishable row).
    state: str
    result: Any = None


@dataclasses.dataclass(frozen=True)
class LimitedCall:
    """One call a limit delayed (re-queued) or refused, as the test saw it.

    ``kind``: ``"rate"`` (a ``rate_limit`` over its window: ``wait`` is the seconds until its place) or
    ``"lock"`` (a full ``concurrency_limit`` or a held ``overlap_lock``: ``holder`` says who holds it,
    ``action`` what the call did: ``retry``, ``skip``, ``raise``). ``at``: the test clock then.
    """

    kind: str
    task: str | None
    task_id: str | None
    key: str
    at: datetime
    wait: float | None = None
    holder: str | None = None
    action: str | None = None


def _decode_row(row: DelayRow, config: SafeTimeConfig) -> StoredDelay:
    body = decode(row.payload, row.content_type, row.content_encoding, allow_pickle=config.allow_pickle)
    return StoredDelay(
        id=row.id,
        task=row.task,
        args=tuple(body.get("args") or ()),
        kwargs=dict(body.get("kwargs") or {}),
        options=dict(body.get("options") or {}),
        due_at=row.due_at,
        status=row.status,
        idempotency_key=row.idempotency_key,
        row=row,
    )


def _task_name(task: Task | str | None) -> str | None:
    if task is None or isinstance(task, str):
        return task
    return str(task.name)


class SafeTimeTesting:
    """The handle of one app under test: its store, lock store and test clock."""

    def __init__(self, app: Celery, store: TestStore | TestSQLiteStore, locks: MemoryLockBackend) -> None:
        self.app = app
        self.store = store
        self.locks = locks
        #: Every call a limit delayed or refused in the block, in order (see :meth:`assert_rate_limited`).
        self.limited: list[LimitedCall] = []

    # --- time ---------------------------------------------------------------------------------
    def now(self) -> datetime:
        """The store's clock (what "due" is measured with): real time plus every advance, held still
        while :meth:`deliver` or :meth:`run_due` runs a call."""
        return self.store.now()

    def advance(self, delta: timedelta | float) -> datetime:
        """Move the clock without running anything (see :meth:`run_due`)."""
        return self.store.advance(delta)

    # --- stored delays ------------------------------------------------------------------------
    def stored_delays(
        self, task: Task | str | None = None, *, status: str | None = C.STATUS_PENDING
    ) -> list[StoredDelay]:
        """The stored calls (pending ones by default, ``status=None`` for all), by due time."""
        name = _task_name(task)
        config = get_config(self.app)
        return [
            _decode_row(row, config)
            for row in self.store.rows()
            if (status is None or row.status == status) and (name is None or row.task == name)
        ]

    def assert_stored(
        self,
        task: Task | str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        due_within: timedelta | None = None,
        due_after: timedelta | None = None,
        count: int | None = None,
    ) -> StoredDelay:
        """Assert a pending stored call of ``task`` (with these args/kwargs, if given) exists and
        return it. ``due_within``: due at most that long from now; ``due_after``: at least that long;
        ``count``: exactly that many match."""
        if count == 0:
            raise ValueError("assert_stored(count=0) asserts nothing is stored: use assert_not_stored()")
        name = _task_name(task)
        now = self.now()
        candidates = self.stored_delays(name)
        matches = [
            d
            for d in candidates
            if (args is None or d.args == tuple(args))
            and (kwargs is None or d.kwargs == dict(kwargs))
            and (due_within is None or d.due_at <= now + due_within)
            and (due_after is None or d.due_at >= now + due_after)
        ]
        wanted = f"{name}(args={args!r}, kwargs={kwargs!r})"
        if due_within is not None:
            wanted += f" due within {due_within}"
        if due_after is not None:
            wanted += f" due after {due_after}"
        self._expect(matches, count, lambda: self._describe(candidates), wanted=f"stored {wanted}")
        return matches[0]

    def assert_not_stored(self, task: Task | str | None = None) -> None:
        """Assert no pending stored call (of ``task``) exists."""
        found = self.stored_delays(task)
        self._expect(found, 0, lambda: self._describe(found), wanted="nothing stored")

    @staticmethod
    def _expect(
        found: Sized, count: int | None, context: Callable[[], str], *, wanted: str, counted: str | None = None
    ) -> None:
        """Fail an ``assert_*`` unless ``found`` holds ``count`` items (``None``: at least one; ``0``: none).

        The message reads "no <wanted>" (nothing found), "expected <count> <counted>, found <n>" (a count
        missed; ``counted`` defaults to ``wanted``) or "expected <wanted>" (``count=0``: something found),
        then what there was: ``context()``, worked out only for a failure.
        """
        if count == 0:
            if len(found):
                raise AssertionError(f"expected {wanted}; {context()}")
        elif count is not None and len(found) != count:
            raise AssertionError(f"expected {count} {counted or wanted}, found {len(found)}; {context()}")
        elif not len(found):
            raise AssertionError(f"no {wanted}; {context()}")

    def _describe(self, delays: Sequence[StoredDelay]) -> str:
        if not delays:
            return "nothing pending of that task"
        now = self.now()
        shown = ", ".join(f"{d.task}(args={d.args!r}, kwargs={d.kwargs!r}) in {d.due_at - now}" for d in delays[:10])
        return f"pending: {shown}{' ...' if len(delays) > 10 else ''}"

    # --- running what is due ------------------------------------------------------------------
    def run_due(
        self,
        advance: timedelta | float = timedelta(0),
        *,
        worker: Any = None,
        propagate: bool = True,
        timeout: float = 30.0,
    ) -> list[RunResult]:
        """Move the clock forward by ``advance``, running every stored delay that comes due, in due order.

        Each row runs when the clock reaches its ``due_at``, and the clock stands still while it runs
        (real time does not move it; docs/testing.md, "The test clock"), so what it stores (a retry, a
        follow-up reminder) counts from there and runs too if due by the end. Eagerly in this thread by
        default (``propagate``: a task's exception is raised here); ``worker=True`` starts a real
        in-process worker (``celery.contrib.testing.worker.start_worker``) for the call,
        ``worker=<WorkController>`` (Celery's ``celery_worker`` fixture) uses a running one: each row is
        published and awaited until its delivery record says finished (``timeout`` seconds each).
        """
        seconds = advance.total_seconds() if isinstance(advance, timedelta) else float(advance)
        if seconds < 0:
            raise ValueError(f"run_due cannot go back in time, got {advance!r}")
        with self.store.held() as now:
            target = now + timedelta(seconds=seconds)
            if worker is True:
                from celery.contrib.testing.worker import start_worker

                with start_worker(self.app, perform_ping_check=False, pool="solo", shutdown_timeout=timeout):
                    return self._run_until(target, publish=True, propagate=propagate, timeout=timeout)
            publish = worker is not None and worker is not False
            return self._run_until(target, publish=publish, propagate=propagate, timeout=timeout)

    def _run_until(self, target: datetime, *, publish: bool, propagate: bool, timeout: float) -> list[RunResult]:
        results: list[RunResult] = []
        config = get_config(self.app)
        for _ in range(MAX_RUNS):
            nxt = self.store.list(status=C.STATUS_PENDING, due_before=target, limit=1)
            if not nxt:
                break
            self.store.advance_to(nxt[0].due_at)
            token = uuid.uuid4().hex
            rows = self.store.claim_due(limit=100, lookahead=0.0, token=token)
            for index, row in enumerate(rows):
                try:
                    results.append(
                        self._run_row(row, token, config, publish=publish, propagate=propagate, timeout=timeout)
                    )
                except BaseException:
                    # The test sees the error; the rows after it stay pending for the next run_due.
                    self.store.release([r.id for r in rows[index + 1 :]], token)
                    raise
        else:
            raise AssertionError(f"run_due stopped after {MAX_RUNS} runs: a task keeps storing itself")
        self.store.advance_to(target)
        return results

    def _run_row(
        self, row: DelayRow, token: str, config: SafeTimeConfig, *, publish: bool, propagate: bool, timeout: float
    ) -> RunResult:
        if row.expires_at is not None and row.claimed_at is not None and row.expires_at <= row.claimed_at:
            if self.store.mark_expired([row.id], token):
                report_revoked(self.app, [row], REASON_EXPIRED, expired=True)  # as the sweep does
            return RunResult(row.id, row.task, row.due_at, "EXPIRED")
        task = self.app.tasks.get(row.task)
        if task is None:
            error = f"LookupError: unknown task {row.task!r} (not registered in this app)"
            self.store.mark_failed(row.id, token, error)
            if propagate:
                raise LookupError(error)
            return RunResult(row.id, row.task, row.due_at, "FAILED", error)
        call = _decode_row(row, config)
        options = dict(call.options)
        headers = dict(options.pop("headers", None) or {})
        # What the sweep adds to every copy it publishes: the delivery record runs as in a worker.
        headers[C.HEADER_STORED] = row.due_at.isoformat()
        # A publish stamps a new attempt: a stored retry() is a new delivery, as on a worker.
        headers[C.HEADER_ATTEMPT] = new_attempt()
        if row.delivery_token:
            headers[C.HEADER_DELIVERY] = row.delivery_token
        self.store.mark_sent([row.id], token)
        if publish:
            return self._publish_and_wait(row, call, options, headers, timeout)
        return self._execute(task, row, call, options, headers, propagate)

    def deliver(
        self,
        task: Task | str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        task_id: str | None = None,
        propagate: bool = True,
    ) -> RunResult:
        """Run one call now as a worker runs a message of it, in this thread, at one instant of the
        test clock (held still while the call runs).

        Not ``apply()``'s eager run: a ``rate_limit`` over its window, a full ``concurrency_limit``
        or a held ``overlap_lock`` re-queues the call as on a worker, into the test store (the
        block's threshold of 0 stores every countdown), where :meth:`run_due` runs it when its
        place comes; ``state`` is ``RETRY`` then. ``retry()`` goes to the store the same way.
        """
        name = _task_name(task)
        found = self.app.tasks.get(name) if name is not None else None
        if found is None:
            raise LookupError(f"unknown task {name!r} (not registered in this app)")
        task_id = task_id or uuid.uuid4().hex
        with self.store.held() as now:
            return self._trace(found, task_id, tuple(args or ()), dict(kwargs or {}), {}, {}, propagate, now)

    def _execute(
        self,
        task: Task,
        row: DelayRow,
        call: StoredDelay,
        options: dict[str, Any],
        headers: dict[str, Any],
        propagate: bool,
    ) -> RunResult:
        return self._trace(task, row.id, call.args, call.kwargs, options, headers, propagate, row.due_at)

    def _trace(
        self,
        task: Task,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        headers: dict[str, Any],
        propagate: bool,
        due_at: datetime,
    ) -> RunResult:
        # A worker-like request, not apply()'s eager one: with is_eager False, retry() and a lock
        # conflict's re-queue go through apply_async (so into the store) instead of re-running at once.
        request: dict[str, Any] = {**headers}
        request.update(
            id=task_id,
            task=task.name,
            args=list(args),
            kwargs=dict(kwargs),
            retries=int(options.get("retries") or 0),
            is_eager=False,
            hostname=_HOST,
            headers=headers,
            root_id=options.get("root_id") or task_id,
            parent_id=options.get("parent_id"),
            callbacks=options.get("link"),
            errbacks=options.get("link_error"),
            ignore_result=options.get("ignore_result", task.ignore_result),
            delivery_info={
                "is_eager": False,
                "exchange": options.get("exchange"),
                "routing_key": options.get("routing_key"),
                "priority": options.get("priority"),
            },
        )
        # propagate=False: Celery's tracer would raise Retry too; only a failure is raised, below.
        tracer = build_tracer(task.name, task, eager=True, propagate=False, app=self.app)
        traced = tracer(task_id, list(args), dict(kwargs), request)
        retval = traced.retval
        exception = getattr(retval, "exception", None)
        if isinstance(exception, ExceptionWithTraceback):
            exception = exception.exc
        state = traced.info.state if traced.info is not None else "SUCCESS"
        if propagate and state == "FAILURE" and isinstance(exception, BaseException):
            raise exception
        return RunResult(task_id, task.name, due_at, state, exception if exception is not None else retval)

    def _publish_and_wait(
        self, row: DelayRow, call: StoredDelay, options: dict[str, Any], headers: dict[str, Any], timeout: float
    ) -> RunResult:
        # No eta: the worker runs on the real clock, and the row is due on the test clock already.
        self.app.send_task(
            row.task,
            args=call.args,
            kwargs=call.kwargs,
            task_id=row.id,
            headers=headers,
            add_to_parent=False,
            **options,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.store.get(row.id)
            if current is None or current.status not in (C.STATUS_SENT, C.STATUS_STARTED):
                outcome = current.outcome if current is not None else None
                # The return value is in the result backend (AsyncResult(id).get()), not in the row.
                error = current.last_error if current is not None else None
                return RunResult(row.id, row.task, row.due_at, (outcome or "gone").upper(), error)
            time.sleep(0.01)
        raise AssertionError(f"stored task {row.task}[{row.id}] did not finish within {timeout}s on the worker")

    # --- flow control ---------------------------------------------------------------------------
    def rate_limited(self, task: Task | str | None = None, *, key: str | None = None) -> list[LimitedCall]:
        """The calls (of ``task``, on rate-limit ``key``) a ``rate_limit`` delayed or refused, in order."""
        name = _task_name(task)
        return [
            c
            for c in self.limited
            if c.kind == "rate" and (name is None or c.task == name) and (key is None or c.key == key)
        ]

    def assert_rate_limited(
        self,
        task: Task | str | None = None,
        *,
        key: str | None = None,
        count: int | None = None,
        wait_at_least: timedelta | float | None = None,
    ) -> list[LimitedCall]:
        """Assert a ``rate_limit`` delayed (in a worker: re-queued to its place, stored here) or refused
        (a direct call: ``RateLimited``) calls of ``task`` on ``key`` (as rendered, ``"stripe:42"``);
        ``count``: exactly that many; ``wait_at_least``: each waited at least that long for its place.
        Returns them. The message lists what the limits did delay."""
        if count == 0:
            raise ValueError("assert_rate_limited(count=0) asserts nothing: use assert_not_rate_limited()")
        matches = self.rate_limited(task, key=key)
        if wait_at_least is not None:
            least = wait_at_least.total_seconds() if isinstance(wait_at_least, timedelta) else float(wait_at_least)
            matches = [c for c in matches if c.wait is not None and c.wait >= least - 1e-6]
        wanted = f"{_task_name(task) or 'any task'} on key {key!r}" if key is not None else _task_name(task) or "any"
        if wait_at_least is not None:
            wanted += f" waiting at least {wait_at_least}"
        self._expect(
            matches,
            count,
            self._limits,
            wanted=f"rate-limited call of {wanted}",
            counted=f"rate-limited calls of {wanted}",
        )
        return matches

    def assert_not_rate_limited(self, task: Task | str | None = None, *, key: str | None = None) -> None:
        """Assert no call (of ``task``, on ``key``) was delayed or refused by a ``rate_limit``."""
        found = self.rate_limited(task, key=key)
        self._expect(found, 0, lambda: self._limits(found), wanted="no rate-limited call")

    def rate_window(self, key: str) -> tuple[int, int]:
        """``(started, waiting)`` of the rate-limit ``key``: calls started within its last period on
        the test clock, and calls re-queued to a place still ahead."""
        for found, started, waiting in self.locks.rate_counts(key):
            if found == key:
                return started, waiting
        return 0, 0

    def _limits(self, found: Sequence[LimitedCall] | None = None) -> str:
        calls = self.limited if found is None else found
        if not calls:
            return "no call was limited"
        shown = ", ".join(
            f"{c.task}[{c.task_id}] on {c.key!r}"
            + (f" waiting {c.wait:.3f}s" if c.wait is not None else f" ({c.action})")
            for c in calls[:10]
        )
        return f"limited: {shown}{' ...' if len(calls) > 10 else ''}"

    def _record(self, kind: str, sender: Any, **fields: Any) -> None:
        try:
            mine = sender is None or sender._get_app() is self.app
        except AttributeError:
            mine = True
        if not mine:
            return
        self.limited.append(
            LimitedCall(
                kind=kind,
                task=getattr(sender, "name", None) or fields.get("task_name"),
                task_id=fields.get("task_id"),
                key=str(fields.get("key")),
                at=self.now(),
                wait=fields.get("wait"),
                holder=fields.get("holder"),
                action=fields.get("action"),
            )
        )

    # --- locks --------------------------------------------------------------------------------
    def assert_lock_held(self, key: str) -> LockInfo:
        """Assert the ``overlap_lock`` (or in-progress ``idempotent``) key is held; returns its holder."""
        info = self.locks.info(self.locks.lock_key(key), self.locks._clock())
        if info is None:
            held = [i.key for i in self.locks.scan()]
            raise AssertionError(f"lock {key!r} is not held (held: {held or 'none'})")
        return info

    def assert_lock_free(self, key: str) -> None:
        """Assert nobody holds the lock ``key``."""
        info = self.locks.info(self.locks.lock_key(key), self.locks._clock())
        if info is not None:
            raise AssertionError(f"lock {key!r} is held by task {info.task_id} (fence {info.fence})")

    def assert_unique_held(self, key: str, *, task_id: str | None = None, state: str | None = None) -> LockInfo:
        """Assert a unique task's key (``unique=`` as rendered, e.g. ``"export:7"``) is held, by
        ``task_id`` and in ``state`` (queued, stored, running, retrying) if given; returns its holder."""
        info = self.locks.unique_info(key, self.locks._clock())
        if info is None:
            held = [i.key for i in self.locks.scan_unique()]
            raise AssertionError(f"unique key {key!r} is not held (held: {held or 'none'})")
        if task_id is not None and info.task_id != task_id:
            raise AssertionError(f"unique key {key!r} is held by task {info.task_id}, not {task_id}")
        if state is not None and info.state != state:
            raise AssertionError(f"unique key {key!r} is {info.state}, not {state}")
        return info

    def assert_unique_free(self, key: str) -> None:
        """Assert nobody holds the unique task key ``key`` (a call would queue)."""
        info = self.locks.unique_info(key, self.locks._clock())
        if info is not None:
            raise AssertionError(f"unique key {key!r} is held by task {info.task_id} ({info.state})")

    def assert_idempotent_done(self, key: str) -> None:
        """Assert the ``idempotent`` key has run within its window."""
        if not self.locks.idempotent_done(key):
            raise AssertionError(f"idempotent key {key!r} has not run (or its window is over)")

    def assert_idempotent_free(self, key: str) -> None:
        """Assert the ``idempotent`` key has not run (a call would run)."""
        if self.locks.idempotent_done(key):
            raise AssertionError(f"idempotent key {key!r} has already run")


# --- set-up ---------------------------------------------------------------------------------------

_active: dict[Celery, SafeTimeTesting] = {}
_MISSING = object()


@contextlib.contextmanager
def safe_time_testing(
    app: Celery,
    *,
    threshold: float | None = 0.0,
    broker_url: str | None = None,
    result_backend: str | None = None,
    store: TestStoreKind = "memory",
) -> Iterator[SafeTimeTesting]:
    """Point ``app`` at an in-memory store and lock store for the block; restore it afterwards.

    The block is the same whatever the app's production settings are: its store, coordination
    (``safe_time_coordination_url``), Redis, broker and result backend are replaced for the block,
    so a test neither fails on them nor reaches them.

    ``store="sqlite"``: the stored delays go to a temporary SQLite file (the production SQL store,
    :class:`TestSQLiteStore`), deleted when the block ends; locks stay in memory either way.

    ``threshold`` (default 0): every call with a countdown or eta is stored, so :meth:`run_due` sees
    every delayed call; None keeps the app's ``safe_time_delay_threshold``. ``task_always_eager`` is
    turned off for the block (it would bypass the store). ``broker_url`` (default ``memory://``: in
    this process) is where immediate calls go; ``result_backend`` (default ``cache+memory://``) is
    where results go. ``safe_time_redis_url`` is a placeholder that names itself if anything still
    reaches for Redis (beat, ``safe-time check``).
    """
    if store not in ("memory", "sqlite"):
        raise ValueError(f"safe_time_testing(store=...) is 'memory' or 'sqlite', got {store!r}")
    delays: TestStore | TestSQLiteStore = TestSQLiteStore() if store == "sqlite" else TestStore()
    changes: dict[str, Any] = {
        "task_always_eager": False,
        "safe_time_store_url": delays.url,
        # Locks are in MemoryLockBackend and nothing here runs beat: no coordination backend is used.
        "safe_time_coordination_url": None,
        "safe_time_redis_url": NO_REDIS_URL,
        "broker_url": broker_url or "memory://",
        # A Redis result backend connects at the first publish, even of a call that is never awaited.
        "result_backend": result_backend or "cache+memory://",
    }
    if threshold is not None:
        changes["safe_time_delay_threshold"] = threshold
    saved = {key: app.conf.get(key, _MISSING) for key in changes}
    app.conf.update(changes)
    _forget_connections(app)
    reset_config(app)
    reset_store(app)
    set_store(app, delays)
    sweep_not_needed(app)  # run_due() publishes the due rows: no sweep to install
    # Rate-limit windows follow the test clock (lock expiry stays on the real one: a lock lives while
    # its task runs); the last moments before a reserved place pass on it too, without sleeping.
    locks = MemoryLockBackend(get_config(app), rate_clock=delays.time, rate_sleep=lambda s: _advance(delays, s))
    use_lock_backend(app, locks)
    handle = SafeTimeTesting(app, delays, locks)

    def on_rate_limited(sender: Any = None, **fields: Any) -> None:
        handle._record("rate", sender, **fields)

    def on_conflict(sender: Any = None, **fields: Any) -> None:
        handle._record("lock", sender, **fields)

    signals.rate_limited.connect(on_rate_limited, weak=False)
    signals.overlap_conflict.connect(on_conflict, weak=False)
    _active[app] = handle
    try:
        yield handle
    finally:
        signals.rate_limited.disconnect(on_rate_limited)
        signals.overlap_conflict.disconnect(on_conflict)
        _active.pop(app, None)
        use_lock_backend(app, None)
        reset_store(app)
        delays.close()
        for key, value in saved.items():
            if value is _MISSING:
                app.conf.pop(key, None)
                # Celery's conf keeps defaults in a lower layer: a popped broker_url is None again.
            else:
                app.conf[key] = value
        _forget_connections(app)
        reset_config(app)


def _advance(store: TestStore | TestSQLiteStore, seconds: float) -> None:
    store.advance(max(0.0, seconds))


def _forget_connections(app: Celery) -> None:
    """Drop the broker pools and result backend ``app`` built from its settings, so the next use
    builds them from the settings in force (Celery caches them on the app at first use)."""
    app._pool = None
    amqp = app.__dict__.get("amqp")  # a cached property: absent until first used
    if amqp is not None:
        amqp._producer_pool = None
    app._backend_cache = None
    app._local.__dict__.pop("backend", None)


def _handle(app: Celery | None, task: Task | str | None = None) -> SafeTimeTesting:
    if app is None and isinstance(task, Task):
        app = task._get_app()
    if app is not None:
        handle = _active.get(app)
        if handle is None:
            raise RuntimeError(f"{app!r} is not under safe_time_testing() (use the safe_time fixture)")
        return handle
    if len(_active) == 1:
        return next(iter(_active.values()))
    raise RuntimeError(
        f"{len(_active)} apps are under safe_time_testing(): pass app=" if _active else "no app is under test"
    )


def stored_delays(task: Task | str | None = None, app: Celery | None = None) -> list[StoredDelay]:
    """The pending stored calls (of ``task``) of the app under test, by due time."""
    return _handle(app, task).stored_delays(task)


def assert_stored(
    task: Task | str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    due_within: timedelta | None = None,
    due_after: timedelta | None = None,
    count: int | None = None,
    app: Celery | None = None,
) -> StoredDelay:
    """See :meth:`SafeTimeTesting.assert_stored`."""
    return _handle(app, task).assert_stored(task, args, kwargs, due_within=due_within, due_after=due_after, count=count)


def run_due(
    advance: timedelta | float = timedelta(0),
    app: Celery | None = None,
    *,
    worker: Any = None,
    propagate: bool = True,
) -> list[RunResult]:
    """See :meth:`SafeTimeTesting.run_due`."""
    return _handle(app).run_due(advance, worker=worker, propagate=propagate)


def deliver(
    task: Task | str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    app: Celery | None = None,
    propagate: bool = True,
) -> RunResult:
    """See :meth:`SafeTimeTesting.deliver`."""
    return _handle(app, task).deliver(task, args, kwargs, propagate=propagate)


def assert_rate_limited(
    task: Task | str | None = None,
    *,
    key: str | None = None,
    count: int | None = None,
    wait_at_least: timedelta | float | None = None,
    app: Celery | None = None,
) -> list[LimitedCall]:
    """See :meth:`SafeTimeTesting.assert_rate_limited`."""
    return _handle(app, task).assert_rate_limited(task, key=key, count=count, wait_at_least=wait_at_least)


def assert_not_rate_limited(
    task: Task | str | None = None, *, key: str | None = None, app: Celery | None = None
) -> None:
    """See :meth:`SafeTimeTesting.assert_not_rate_limited`."""
    _handle(app, task).assert_not_rate_limited(task, key=key)


def assert_lock_held(key: str, app: Celery | None = None) -> LockInfo:
    return _handle(app).assert_lock_held(key)


def assert_lock_free(key: str, app: Celery | None = None) -> None:
    _handle(app).assert_lock_free(key)


def assert_idempotent_done(key: str, app: Celery | None = None) -> None:
    _handle(app).assert_idempotent_done(key)


def assert_unique_held(
    key: str, app: Celery | None = None, *, task_id: str | None = None, state: str | None = None
) -> LockInfo:
    """See :meth:`SafeTimeTesting.assert_unique_held`."""
    return _handle(app).assert_unique_held(key, task_id=task_id, state=state)


def assert_unique_free(key: str, app: Celery | None = None) -> None:
    """See :meth:`SafeTimeTesting.assert_unique_free`."""
    _handle(app).assert_unique_free(key)


# --- schedules ------------------------------------------------------------------------------------


def next_fires(
    schedule_or_entry: Any,
    n: int = 5,
    after: datetime | None = None,
    *,
    app: Celery | None = None,
    tz: str | tzinfo | None = None,
) -> list[datetime]:
    """The next ``n`` instants (aware UTC) at which beat fires this schedule or entry, DST rules included.

    Takes a schedule (``celery_safe_time.crontab``, Celery's ``crontab``, a number of seconds, a
    ``timedelta``, a ``schedule``), a ``beat_schedule`` dict entry, or anything with ``.schedule``.
    A plain Celery crontab is read in ``tz``, else ``app.timezone``, else UTC, as beat reads it in
    the app's timezone. ``after`` (naive = UTC) defaults to now. An interval's grid starts where beat
    first sees the entry: the first fire is ``after`` (rounded up to a second), then every interval.
    """
    from .beat.slots import grid_for
    from .schedules import resolve_tz

    schedule = schedule_or_entry
    if isinstance(schedule, Mapping):
        schedule = schedule["schedule"]
    elif hasattr(schedule, "schedule") and not hasattr(schedule, "remaining_estimate"):
        schedule = schedule.schedule
    if tz is not None:
        zone = resolve_tz(tz)
    elif app is not None:
        zone = app.timezone
    else:
        zone = UTC
    start = as_utc(after).timestamp() if after is not None else local_time()
    grid = grid_for(schedule, zone)
    fires: list[datetime] = []
    slot = grid.first(start)
    for _ in range(n):
        if not math.isfinite(slot):
            break
        fires.append(to_datetime(slot))
        slot = grid.next(slot)
    return fires


# --- the pytest plugin (entry point ``pytest11``: celery_safe_time = celery_safe_time.testing) -----

try:
    import pytest
except ImportError:  # pragma: no cover - usable without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def safe_time_app() -> Iterator[Celery]:
        """The app under test. Override it in your conftest.py to return your own app
        (or Celery's ``celery_app`` fixture); the default is a fresh app, current for the test."""
        app = Celery("safe_time_test", broker="memory://", task_cls="celery_safe_time:SafeTask", set_as_current=False)
        try:
            with _current(app):
                yield app
        finally:
            app.close()

    @pytest.fixture
    def safe_time_options() -> dict[str, Any]:
        """Keyword arguments of :func:`safe_time_testing` (override: ``{"broker_url": "memory://"}``)."""
        return {}

    @pytest.fixture
    def safe_time(safe_time_app: Celery, safe_time_options: dict[str, Any]) -> Iterator[SafeTimeTesting]:
        """``safe_time_app`` with the in-memory store, lock store and test clock (:class:`SafeTimeTesting`)."""
        with safe_time_testing(safe_time_app, **safe_time_options) as handle:
            yield handle

    @pytest.fixture
    def safe_time_sqlite(safe_time_app: Celery, safe_time_options: dict[str, Any]) -> Iterator[SafeTimeTesting]:
        """As ``safe_time``, with the stored delays in a temporary SQLite file (the SQL store)."""
        with safe_time_testing(safe_time_app, **{**safe_time_options, "store": "sqlite"}) as handle:
            yield handle


@contextlib.contextmanager
def _current(app: Celery) -> Iterator[None]:
    """Make ``app`` the current (and default) app for the block, so ``@shared_task`` binds to it."""
    from celery import _state

    previous = _state.get_current_app()
    app.set_current()
    try:
        yield
    finally:
        _state._set_current_app(previous)
