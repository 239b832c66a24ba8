"""The sweep: publish due stored delays, once each, with ``eta=due_at``.

Run by beat every ``safe_time_sweep_interval`` (task ``celery_safe_time.sweep``) and by
``celery safe-time sweep``. Any number of sweeps may run at once: claims use the store's
row locks (``FOR UPDATE SKIP LOCKED``), so each row goes to one sweeper.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from celery import Celery, Task
from celery._state import _task_stack
from celery.utils import uuid

from .. import constants as C
from .. import signals
from ..config import SafeTimeConfig, get_config
from ..exceptions import StoreError
from .backends import get_store
from .backends.base import DelayRow, DelayStore
from .confirms import ConfirmSession, publish_batch_confirmed
from .maintenance import confirm_deliveries, purge_retained
from .plan import adaptive_lookahead
from .publish import Batch, SweepStats, close_expired, mark_sent_retrying, publish_batch
from .revoked import REASON_EXPIRED, report_revoked

__all__ = ["SweepStats", "plan_lookahead", "register", "sweep"]

logger = logging.getLogger(__name__)

#: The look-ahead covers the backlog's publishing time this many times over (the rate estimate is
#: one sweeper's; beat may start the next sweep only one interval later).
SWEEP_LOOKAHEAD_SAFETY = 2.0
#: Rows per second one sweep is assumed to publish until it has measured itself.
SWEEP_RATE_GUESS = 1000.0

R = TypeVar("R")


def sweep(
    app: Celery,
    *,
    store: DelayStore | None = None,
    batch: int | None = None,
    lookahead: float | None = None,
    max_batches: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SweepStats:
    """Reclaim stale claims, then claim and publish due rows batch by batch while batches are full.

    ``lookahead`` defaults to :func:`plan_lookahead` (2 s, more under a backlog due soon, less under a
    short broker consumer timeout); a number fixes it.
    With ``safe_time_delay_retention`` set, finally purge old finished rows when this process's purge
    is due by ``clock`` (monotonic seconds; tests pass their own).
    """
    with _outside_worker_task():
        return _sweep(app, store=store, batch=batch, lookahead=lookahead, max_batches=max_batches, clock=clock)


@contextmanager
def _outside_worker_task() -> Iterator[None]:
    """Publish each row as its caller would have: outside the worker task that runs this sweep.

    ``send_task`` fills a message's missing ``root_id`` and ``parent_id`` (and, with
    ``task_inherit_parent_priority``, its priority) from the worker task it runs in: in the sweep
    task, the sweep's own id, so every workflow stored from outside a task would share that root.
    A call Celery publishes from outside a task is its own root, with no parent; a call made in a
    task has those ids stored with it. Celery has no way to publish "as no task", so this thread's
    task stack is set aside for the sweep and put back after it.
    """
    hidden: list[Any] = []
    while _task_stack.top is not None:
        hidden.append(_task_stack.pop())
    try:
        yield
    finally:
        while hidden:
            _task_stack.push(hidden.pop())


def _sweep(
    app: Celery,
    *,
    store: DelayStore | None,
    batch: int | None,
    lookahead: float | None,
    max_batches: int | None,
    clock: Callable[[], float],
) -> SweepStats:
    config = get_config(app)
    store = store if store is not None else get_store(app)
    batch = batch or config.sweep_batch
    stats = SweepStats(reclaimed=store.reclaim_stale(config.claim_timeout))
    if stats.reclaimed:
        logger.warning("reclaimed %d stored delays claimed over %gs ago", stats.reclaimed, config.claim_timeout)
    confirm_deliveries(app, config, store, stats, limit=batch)
    if lookahead is None:
        lookahead = plan_lookahead(config, store)
    stats.lookahead = lookahead
    started = clock()
    # On RabbitMQ the batches of this sweep share one connection in confirm mode (opened at the first).
    session = ConfirmSession(app, config) if config.broker_kind == C.BROKER_AMQP else None
    claims = _Claims(store, batch, lookahead, clock)
    marks = Marks(app, claims, stats, clock)
    batch_marks = marks if store.claims_in_background else None  # else each batch marks in line
    try:
        claim = claims.make() if max_batches is None or max_batches > 0 else _Claim([], "", clock())
        while claim.rows:
            rows, token, claimed_at = claim.rows, claim.token, claim.claimed_at
            stats.batches += 1
            stats.claimed += len(rows)
            last = len(rows) < batch or (max_batches is not None and stats.batches >= max_batches)
            # The next batch is claimed while this one publishes (a thread, where the store allows).
            following = None if last else claims.next()
            try:
                trusted_until = claimed_at + config.claim_timeout / 2
                job = Batch(app, config, store, rows, token, stats, trusted_until, clock, batch_marks)
                if session is not None:
                    publish_batch_confirmed(session, job)
                else:
                    publish_batch(job)
            except BaseException:
                claims.hand_back(following)
                raise
            if following is None:
                break
            if stats.unconfirmed:
                # A broker that did not confirm this batch (an alarm) would hold the next one the same way.
                claims.hand_back(following)
                break
            claim = following.result()
        marks.collect()
    finally:
        # After an error: the batches already published are still marked (or logged), not raised over it.
        marks.collect(quiet=True)
        claims.close()
        if session is not None:
            session.close()
    if stats.claimed >= batch:
        _measured_rate(store, stats.claimed / max(clock() - started, 1e-3))
    if stats.claimed:
        logger.info(
            "sweep: %d claimed, %d sent, %d expired, %d failed (look-ahead %.1fs)",
            stats.claimed,
            stats.sent,
            stats.expired,
            stats.failed,
            lookahead,
        )
    if config.delay_retention is not None:
        stats.purged = purge_retained(store, config.delay_retention, clock=clock)
    return stats


@dataclasses.dataclass
class _Claim:
    rows: list[DelayRow]
    token: str
    #: ``clock()`` when the claim returned: its age counts from here, not from the publish. A publisher
    #: slowed down past half the claim timeout stops, since another sweeper may reclaim the same rows.
    claimed_at: float


class _Deferred:
    """The next claim, made when its result is asked for (after this batch's publish)."""

    def __init__(self, make: Callable[[], _Claim]) -> None:
        self._make = make

    def result(self) -> _Claim:
        return self._make()


class _Claims:
    """One sweep's claims. On a store that allows it (``claims_in_background``) the next batch is claimed
    in a thread of the sweep's own while the current one publishes: the claim's round trips to the
    database overlap the publish's CPU and the broker's confirms instead of adding to them. A claim
    made ahead but not published (the publish failed, the broker stopped confirming) goes back to
    pending at once.
    """

    def __init__(self, store: DelayStore, batch: int, lookahead: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.batch = batch
        self.lookahead = lookahead
        self.clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._mark_pool: ThreadPoolExecutor | None = None

    def run(self, work: Callable[[], R]) -> Future[R]:
        """``work`` in the sweep's mark thread."""
        # A thread of its own, beside the claim thread: a batch's mark and the claim ahead touch other
        # rows (claimed ones, pending ones) and both mostly wait for the database, so neither waits
        # for the other; one thread keeps the marks in batch order.
        if self._mark_pool is None:
            self._mark_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safe-time-mark")
        return self._mark_pool.submit(work)

    def make(self) -> _Claim:
        token = uuid()
        rows = self.store.claim_due(limit=self.batch, lookahead=self.lookahead, token=token)
        return _Claim(rows, token, self.clock())

    def next(self) -> Future[_Claim] | _Deferred:
        if not self.store.claims_in_background:
            return _Deferred(self.make)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safe-time-claim")
        return self._pool.submit(self.make)

    def hand_back(self, following: Future[_Claim] | _Deferred | None) -> None:
        """Release a claim made ahead that this sweep will not publish."""
        if following is None or isinstance(following, _Deferred):
            return
        try:
            claim = following.result()
            if claim.rows:
                self.store.release([r.id for r in claim.rows], claim.token)
        except StoreError as exc:
            # Left claimed: reclaimed after the claim timeout, as any claim of a sweeper that stopped.
            logger.warning("sweep: could not hand back the batch claimed ahead: %s", exc)

    def close(self) -> None:
        for pool in (self._mark_pool, self._pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._mark_pool = None


class Marks:
    """The mark sent (and expired) of each published batch, made in a thread while the next batch is
    built and published, so its round trip overlaps the next batch's CPU (about a sixth of the sweep
    otherwise). A batch is handed over only once its publish reached the broker; one thread marks the
    batches in order, and each hand-over (and the sweep's end) waits for the one before: its count goes
    into the stats, ``delay_released`` is sent from the sweep's thread, and a store error after
    :func:`mark_sent_retrying` fails the sweep (the rows stay claimed and are published again after the
    claim timeout). Stores without background claims (SQLite, Django) mark in line.
    """

    def __init__(self, app: Celery, claims: _Claims, stats: SweepStats, clock: Callable[[], float]) -> None:
        self.app = app
        self.claims = claims
        self.stats = stats
        self.clock = clock
        self._pending: tuple[Future[tuple[int, list[DelayRow]]], list[DelayRow]] | None = None

    def submit(
        self, store: DelayStore, sent: list[DelayRow], expired: list[DelayRow], token: str, trusted_until: float
    ) -> None:
        """Mark a published batch's rows; its retry budget is what is left of its claim's trust when it runs."""
        clock = self.clock
        ids = [r.id for r in sent]

        def work() -> tuple[int, list[DelayRow]]:
            marked = mark_sent_retrying(store, ids, token, budget=max(0.0, trusted_until - clock()))
            return marked, close_expired(store, expired, token)

        previous, self._pending = self._pending, (self.claims.run(work), sent)
        if previous is not None:
            self._settle(*previous)

    def collect(self, *, quiet: bool = False) -> None:
        """Wait for the mark handed over last; ``quiet``: log its error instead of raising it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            self._settle(*pending)
        except Exception as exc:
            if not quiet:
                raise
            logger.warning("sweep: marking the last published batch failed: %s", exc)

    def _settle(self, marking: Future[tuple[int, list[DelayRow]]], sent: list[DelayRow]) -> None:
        marked, expired = marking.result()
        self.stats.sent += marked
        self.stats.expired += len(expired)
        for row in sent:
            signals.delay_released.send(sender=self.claims.store, task_id=row.id, task_name=row.task, due_at=row.due_at)
        # From the sweep's own thread, as the signals: the app's result backend is per thread.
        report_revoked(self.app, expired, REASON_EXPIRED, expired=True)


#: Per store object (so per process): the rows per second its recent sweeps claimed and published.
_rates: weakref.WeakKeyDictionary[DelayStore, float] = weakref.WeakKeyDictionary()


def _measured_rate(store: DelayStore, rate: float) -> None:
    previous = _rates.get(store)
    # Smoothed: one sweep slowed down by a busy host must not halve the next look-ahead's estimate.
    _rates[store] = rate if previous is None else (previous + rate) / 2


def plan_lookahead(config: SafeTimeConfig, store: DelayStore) -> float:
    """The look-ahead of this sweep: ``sweep_lookahead``, or more when a backlog is due soon.

    Rows due within the broker's safe window (``sweep_lookahead_max``) are counted, up to
    ``safe_time_sweep_max_ahead``; the sweep claims ahead twice the time this process needs to publish
    them (its measured rate) plus one sweep interval, so a burst of rows due at one instant is out by
    then, each with ``eta=due_at``. One extra store query per sweep; a store error keeps the fixed look-ahead.
    """
    base, ceiling = config.sweep_lookahead, config.sweep_lookahead_max
    if ceiling <= base:
        return base
    try:
        now = store.now()
        count, last_due = store.pending_ahead(now + timedelta(seconds=ceiling), config.sweep_max_ahead)
    except StoreError as exc:
        logger.warning("sweep: cannot size the look-ahead (%s); using %gs", exc, base)
        return base
    reached = (last_due - now).total_seconds() if count >= config.sweep_max_ahead and last_due else None
    return adaptive_lookahead(
        count,
        _rates.get(store, SWEEP_RATE_GUESS),
        base=base,
        ceiling=ceiling,
        limit_reached_in=reached,
        safety=SWEEP_LOOKAHEAD_SAFETY,
        interval=config.sweep_interval,
    )


def register(app: Celery, config: SafeTimeConfig) -> None:
    """Register the sweep task and its beat entry on ``app``."""

    @app.task(name=C.SWEEP_TASK_NAME, base=Task, ignore_result=True, shared=False)
    def safe_time_sweep() -> dict[str, Any]:
        return sweep(app).as_dict()

    options: dict[str, Any] = {"expires": config.sweep_interval}
    if config.sweep_queue:
        options["queue"] = config.sweep_queue
    schedule = dict(app.conf.beat_schedule or {})
    schedule[C.SWEEP_ENTRY_NAME] = {
        "task": C.SWEEP_TASK_NAME,
        "schedule": config.sweep_interval,
        "options": options,
    }
    app.conf.beat_schedule = schedule
