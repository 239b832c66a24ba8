"""The handle of an app under test (:class:`SafeTimeTesting`), what it reads, and the block that sets it up
(:func:`safe_time_testing`)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from datetime import datetime, timedelta
from typing import Any, Literal

from billiard.einfo import ExceptionWithTraceback
from celery import Celery, Task
from celery.app.trace import build_tracer

from .. import constants as C
from .. import signals
from ..config import SafeTimeConfig, get_config, reset_config
from ..delays.backends import reset_store, set_store
from ..delays.backends.base import DelayRow
from ..delays.payload import decode
from ..delays.revoked import REASON_EXPIRED, report_revoked
from ..install_check import sweep_not_needed
from ..locks.backends import LockInfo, use_lock_backend
from ..locks.backends.memory import MemoryLockBackend
from ..messages.requeue import new_attempt
from .stores import TestSQLiteStore, TestStore

#: The stores a test can ask for (``safe_time_testing(store=...)``).
TestStoreKind = Literal["memory", "sqlite"]

#: ``safe_time_redis_url`` of a testing app: a socket that cannot exist, named so that the error of
#: anything that still tries Redis (beat, ``safe-time check``) says why.
NO_REDIS_URL = "unix:///nonexistent/celery-safe-time-testing-has-no-redis.sock"

#: run_due stops after this many runs: a task that stores itself again with no delay would loop.
MAX_RUNS = 10_000

_HOST = socket.gethostname()


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
        """Fail an ``assert_*`` unless ``found`` holds ``count`` items (``None``: at least one; ``0``: none),
        saying what there was: ``context()``, worked out only for a failure."""
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
        return self._trace(task, row.id, call.args, call.kwargs, options, headers, propagate, row.due_at)

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
