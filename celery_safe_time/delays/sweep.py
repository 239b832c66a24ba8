"""The sweep: publish due stored delays, once each, with ``eta=due_at``.

Run by beat every ``safe_time_sweep_interval`` (task ``celery_safe_time.sweep``) and by
``celery safe-time sweep``. Any number of sweeps may run at once: claims use the store's
row locks (``FOR UPDATE SKIP LOCKED``), so each row goes to one sweeper.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from celery import Celery, Task
from celery.utils import uuid
from kombu.exceptions import BatchPublishError, OperationalError

from .. import constants as C
from .. import signals
from ..config import SafeTimeConfig, get_config
from ..exceptions import StoreError
from ..publishing import PublishBatch, batched_publish
from ..tracing import in_stored_context
from .amqp_batch import BatchProducer, BatchSender
from .backends import get_store
from .backends.base import DelayRow, DelayStore
from .delivery import reruns_when_stale
from .payload import decode
from .plan import adaptive_lookahead

logger = logging.getLogger(__name__)

R = TypeVar("R")


@dataclasses.dataclass
class SweepStats:
    """What one sweep did."""

    reclaimed: int = 0
    claimed: int = 0
    sent: int = 0
    expired: int = 0
    failed: int = 0
    batches: int = 0
    #: Finished rows deleted by the retention purge (``safe_time_delay_retention``).
    purged: int = 0
    #: Sent rows never started within ``safe_time_delivery_grace``: back to pending, published again.
    republished: int = 0
    #: Started rows whose heartbeat stopped: acks_late ones to run again, the others marked interrupted.
    rerun: int = 0
    interrupted: int = 0
    #: Claimed rows left unpublished because this sweep's claim had grown too old to trust.
    abandoned: int = 0
    #: Rows published to RabbitMQ but not confirmed in time (a memory or disk alarm): back to pending.
    unconfirmed: int = 0
    #: Seconds ahead of their due time this sweep claimed rows (grows under a backlog due soon).
    lookahead: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    session = _ConfirmSession(app, config) if config.broker_kind == C.BROKER_AMQP else None
    claims = _Claims(store, batch, lookahead, clock)
    marks = _Marks(claims, stats, clock)
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
                if session is not None:
                    _publish_batch_confirmed(
                        session, config, store, rows, token, stats, claimed_at=claimed_at, clock=clock, marks=marks
                    )
                else:
                    _publish_batch(
                        app, config, store, rows, token, stats, claimed_at=claimed_at, clock=clock, marks=marks
                    )
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
        """``work`` in the sweep's mark thread, or here and now where claims are not made in the background."""
        if not self.store.claims_in_background:
            done: Future[R] = Future()
            try:
                done.set_result(work())
            except BaseException as exc:
                done.set_exception(exc)
            return done
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


class _Marks:
    """The mark sent (and expired) of each published batch, made in a thread while the next batch is
    built and published: the statement's round trip and the database's row updates (about a sixth of
    the sweep's wall time when made in line) overlap the next batch's CPU instead of adding to it. A
    batch is handed over only once its publish reached the broker (the Redis pipeline ran, RabbitMQ
    confirmed), so "published, then marked" holds as before; one thread keeps the marks one at a
    time, in batch order. The next hand-over (and the end of the sweep) waits for the one before: its
    count goes into the stats, ``delay_released`` is sent for its rows from the sweep's own thread,
    and a store error after its retries (``mark_sent_retrying``, within half the claim timeout from
    the claim) fails the sweep as it did in line; its rows stay claimed and are published again
    after the claim timeout (the delivery record runs each once). Stores without background claims
    (SQLite, Django) mark in line, as before.
    """

    def __init__(self, claims: _Claims, stats: SweepStats, clock: Callable[[], float]) -> None:
        self.claims = claims
        self.stats = stats
        self.clock = clock
        self._pending: tuple[Future[tuple[int, int]], list[DelayRow]] | None = None

    def submit(
        self, store: DelayStore, sent: list[DelayRow], expired: list[str], token: str, trusted_until: float
    ) -> None:
        """Mark a published batch's rows; its retry budget is what is left of its claim's trust when it runs."""
        clock = self.clock
        ids = [r.id for r in sent]

        def work() -> tuple[int, int]:
            marked = mark_sent_retrying(store, ids, token, budget=max(0.0, trusted_until - clock()))
            return marked, store.mark_expired(expired, token)

        marking = self.claims.run(work)
        if not store.claims_in_background:
            self._settle(marking, sent)  # made in line: counted and signalled now, as before
            return
        previous, self._pending = self._pending, (marking, sent)
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

    def _settle(self, marking: Future[tuple[int, int]], sent: list[DelayRow]) -> None:
        marked, expired = marking.result()
        self.stats.sent += marked
        self.stats.expired += expired
        for row in sent:
            signals.delay_released.send(sender=self.claims.store, task_id=row.id, task_name=row.task, due_at=row.due_at)


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
        _rates.get(store, C.SWEEP_RATE_GUESS),
        base=base,
        ceiling=ceiling,
        limit_reached_in=reached,
        safety=C.SWEEP_LOOKAHEAD_SAFETY,
        interval=config.sweep_interval,
    )


def confirm_deliveries(
    app: Celery, config: SafeTimeConfig, store: DelayStore, stats: SweepStats, *, limit: int
) -> None:
    """Delivery confirmation: a published row must start, a started row must keep its heartbeat.

    A row ``sent`` but not started ``safe_time_delivery_grace`` after its due time lost its message
    (a broker restart, kombu's window between BRPOP and the unacked copy on a worker ``kill -9``): it
    goes back to pending with the same token and is published again; the conditional start keeps it
    to one run. A row ``started`` whose heartbeat is older than ``safe_time_lock_ttl`` lost its worker:
    an ``acks_late`` task runs again (at least once, as acks_late promises), any other task is
    marked ``interrupted`` and not run again (at most once).
    """
    try:
        stats.republished = store.requeue_unstarted(config.delivery_grace)
        if stats.republished:
            logger.warning(
                "%d stored delays were published but not started within %gs: publishing them again",
                stats.republished,
                config.delivery_grace,
            )
        stale = store.stale_started(config.lock_ttl, limit)
    except StoreError as exc:
        logger.warning("delivery confirmation skipped this sweep: %s", exc)
        return
    for row in stale:
        task = app.tasks.get(row.task)
        rerun = reruns_when_stale(task)
        try:
            changed = store.end_stale(row.id, row.delivery_token or "", config.lock_ttl, rerun=rerun)
        except StoreError as exc:
            logger.warning("delivery confirmation of %s[%s] skipped: %s", row.task, row.id, exc)
            continue
        if not changed:
            continue
        if rerun:
            stats.rerun += 1
            logger.warning(
                "stored task %s[%s] started on %s but its heartbeat stopped: running it again (acks_late)",
                row.task,
                row.id,
                row.worker,
            )
        else:
            stats.interrupted += 1
            logger.warning(
                "stored task %s[%s] started on %s but its heartbeat stopped: interrupted, not run again",
                row.task,
                row.id,
                row.worker,
            )


#: Per store object (so per process): the ``clock()`` time before which its next purge pass waits.
_next_purge: weakref.WeakKeyDictionary[DelayStore, float] = weakref.WeakKeyDictionary()
_purge_lock = threading.Lock()


def purge_retained(
    store: DelayStore,
    retention: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    interval: float = C.PURGE_INTERVAL,
    max_batches: int = C.PURGE_SWEEP_MAX_BATCHES,
    batch: int = C.PURGE_BATCH,
) -> int:
    """Delete sent/cancelled/expired rows older than ``retention`` seconds, if this process's pass is due.

    A pass starts at most once per ``interval``; each call deletes at most ``max_batches`` batches so
    the sweep that runs it is never held up. A pass that hit that cap goes on at the next sweep
    instead of waiting out the interval, so a busy table still shrinks. Failed rows are never
    purged here: they wait for an operator. A store error is logged, not raised: the sweep's
    publishing already happened and must be reported.
    """
    with _purge_lock:
        now = clock()
        if now < _next_purge.get(store, now):
            return 0
        # Claim the pass before running it so concurrent sweeps of this process skip it.
        _next_purge[store] = now + interval
    purged = 0
    try:
        before = store.now() - timedelta(seconds=retention)
        for _ in range(max_batches):
            deleted = store.purge(before, C.PURGE_DEFAULT_STATUSES, batch)
            purged += deleted
            if deleted < batch:
                break
        else:
            with _purge_lock:
                _next_purge[store] = now  # more left: carry on at the next sweep
    except StoreError as exc:
        logger.warning("retention purge stopped after %d rows, retrying in %.0fs: %s", purged, interval, exc)
    if purged:
        logger.info("retention purge: deleted %d finished stored delays older than %gs", purged, retention)
    return purged


def _publish_batch(
    app: Celery,
    config: SafeTimeConfig,
    store: DelayStore,
    rows: list[DelayRow],
    token: str,
    stats: SweepStats,
    *,
    claimed_at: float,
    clock: Callable[[], float] = time.monotonic,
    marks: _Marks | None = None,
) -> None:
    sent: list[DelayRow] = []
    expired: list[str] = []
    index = 0
    trusted_until = claimed_at + config.claim_timeout / 2
    batch = PublishBatch()
    try:
        with _producer(app, config) as producer, batched_publish(producer, len(rows), batch):
            # send_task's per-row work with what a batch shares looked up once (see amqp_batch).
            send = BatchSender(app, producer).send_task
            for row in rows:
                if clock() > trusted_until:
                    _abandon(store, config, rows[index:], token, stats)
                    break
                outcome = _publish_row(app, config, store, row, token, producer, send=send)
                if outcome == C.STATUS_SENT:
                    sent.append(row)
                elif outcome == C.STATUS_EXPIRED:
                    expired.append(row.id)
                else:
                    stats.failed += 1
                index += 1
    except (OperationalError, BatchPublishError) as exc:
        # The broker is down. Unbatched: what was published stays published, the rest goes back to
        # pending now instead of waiting out the claim timeout. Batched: nothing buffered went out
        # (the batch was discarded), or the pipeline failed and which LPUSHes Redis ran is unknown;
        # either way the rows go back to pending and are published again, and the delivery record
        # runs a row that arrives twice once.
        published = [] if batch.active else sent
        done = {r.id for r in published} | set(expired)
        rest = [r.id for r in rows if r.id not in done]
        store.release(rest, token)
        _finish(store, published, expired, token, stats, max(0.0, trusted_until - clock()))
        if isinstance(exc, BatchPublishError):
            raise OperationalError(f"publishing stored delays: {exc}: {exc.__cause__}") from exc
        raise
    if marks is not None:
        marks.submit(store, sent, expired, token, trusted_until)
        return
    _finish(store, sent, expired, token, stats, max(0.0, trusted_until - clock()))


def publish_wait(config: SafeTimeConfig) -> float:
    """The longest a sweep waits for the broker on one publish (or a batch's confirms): a broker
    that stops answering leaves the rows to be published again, not a sweep that never returns."""
    return min(C.SWEEP_CONFIRM_TIMEOUT, config.claim_timeout / 4)


@contextmanager
def _producer(app: Celery, config: SafeTimeConfig) -> Iterator[Any]:
    """The producer a batch is published with. On Redis a connection of its own whose socket has a
    deadline (:func:`publish_wait`; kombu's default is none, and a connection the broker stopped
    answering without closing it would hold the sweep for ever), unless the broker's transport
    options set one. Elsewhere the app's pooled producer."""
    if config.broker_kind != C.BROKER_REDIS:
        with app.producer_or_acquire() as producer:
            yield producer
        return
    options = dict(app.conf.broker_transport_options or {})
    wait = publish_wait(config)
    options.setdefault("socket_timeout", wait)
    options.setdefault("socket_connect_timeout", wait)
    conn = app.connection_for_write(transport_options=options)
    try:
        yield app.amqp.Producer(conn)
    finally:
        conn.release()


def _abandon(
    store: DelayStore, config: SafeTimeConfig, rest_rows: list[DelayRow], token: str, stats: SweepStats
) -> None:
    rest = [r.id for r in rest_rows]
    stats.abandoned += len(rest)
    store.release(rest, token)
    logger.warning(
        "sweep: publishing was slower than half the claim timeout (%gs); handing %d claimed rows "
        "back instead of racing a sweeper that may have reclaimed them",
        config.claim_timeout,
        len(rest),
    )


class PublisherConfirms:
    """Publisher confirms on one AMQP channel, tracked per publish.

    In confirm mode RabbitMQ numbers the channel's publishes 1, 2, 3, ... and answers each with
    ``basic.ack`` once it has taken responsibility for the message (routed to its queues, on disk for
    durable ones) or ``basic.nack``; one answer may settle every number up to its own (``multiple``).
    Waiting for each answer before the next publish (kombu's ``confirm_publish``) costs a round trip
    per row, about 8x slower here, so a batch is published first and its answers collected after.
    Publishes are numbered where they really happen, so a row that fails before (or, through a
    signal handler, after) its publish cannot shift the count: :meth:`number` for the ones the
    sweep's :class:`~.amqp_batch.BatchProducer` buffers, and a wrapper of the channel's
    ``basic_publish`` for any other (which writes what is buffered first: the order is the numbering).
    """

    def __init__(self, channel: Any) -> None:
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        publish = channel.basic_publish

        def numbered(*args: Any, **kwargs: Any) -> Any:
            self.flush_buffered()
            self.number()
            return publish(*args, **kwargs)

        channel.basic_publish = numbered
        #: The row being published now (set by the sweep before each send).
        self.current = ""
        self.published = 0
        #: Writes what a buffering producer on this channel holds (set by the sweep).
        self.flush_buffered: Callable[[], None] = lambda: None
        #: delivery tag -> row id.
        self.tags: dict[int, str] = {}
        #: delivery tag -> True (acked) / False (nacked), for the tags answered so far.
        self.settled: dict[int, bool] = {}
        #: The tags not answered yet, in publish order (a dict: ordered, O(1) removal).
        self._unsettled: dict[int, None] = {}

    def new_batch(self) -> None:
        """Forget the settled tags of the batches before (a new batch starts with none open)."""
        self.tags = {t: self.tags[t] for t in self._unsettled}
        self.settled = {}

    def number(self) -> None:
        """Count one publish of the current row (RabbitMQ numbers them 1, 2, ... in arrival order)."""
        self.published += 1
        self.tags[self.published] = self.current
        self._unsettled[self.published] = None

    @property
    def waiting(self) -> bool:
        return bool(self._unsettled)

    def confirmed(self) -> set[str]:
        """Ids of the rows RabbitMQ acknowledged (a row nacked on any of its publishes is not)."""
        acked = {self.tags[t] for t, ok in self.settled.items() if ok}
        nacked = {self.tags[t] for t, ok in self.settled.items() if not ok}
        unsettled = {self.tags[t] for t in self._unsettled}
        return acked - nacked - unsettled

    def _settle(self, delivery_tag: int, multiple: bool, acked: bool) -> None:
        if multiple:
            # The oldest open tags up to this one: a walk from the front, not a scan of the batch.
            done = []
            for tag in self._unsettled:
                if tag > delivery_tag:
                    break
                done.append(tag)
        else:
            done = [delivery_tag] if delivery_tag in self._unsettled else []
        for tag in done:
            self.settled[tag] = acked
            del self._unsettled[tag]

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, False)


class _ConfirmSession:
    """The RabbitMQ side of one sweep: a connection of its own, one channel in confirm mode, reused
    by the sweep's batches while it stays healthy.

    Our own connection, not the app's pool: confirm mode stays on the channel it was selected on,
    and kombu's publish retry would republish on a new channel whose numbering starts again. Opened
    at the first batch (an AMQP handshake, a channel, ``confirm.select``, the queue declares: round
    trips a batch need not pay again); dropped without a close handshake after a broker error or a
    batch left unconfirmed, so the next batch starts on a new one.
    """

    def __init__(self, app: Celery, config: SafeTimeConfig) -> None:
        self.app = app
        self.confirm_wait = publish_wait(config)
        self.conn: Any = None
        self._parts: tuple[PublisherConfirms, BatchProducer, BatchSender] | None = None
        self.broker_errors: tuple[type[BaseException], ...] = (OperationalError, OSError)

    def open(self) -> tuple[PublisherConfirms, BatchSender]:
        """The session's confirms and sender, connecting first if needed; a new batch's bookkeeping."""
        if self.conn is None or self._parts is None:
            conn = self.app.connection_for_write(
                transport_options={"confirm_publish": False, "write_timeout": self.confirm_wait}
            )
            self.conn = conn
            self.broker_errors = (OperationalError, OSError, *conn.connection_errors, *conn.channel_errors)
            conn.ensure_connection(max_retries=1)
            channel = conn.default_channel
            confirms = PublisherConfirms(channel)
            # Publishes are buffered and written once per batch (see amqp_batch); send_task's work per row.
            producer = BatchProducer(channel, on_publish=confirms.number)
            confirms.flush_buffered = producer.flush
            self._parts = (confirms, producer, BatchSender(self.app, producer))
        assert self._parts is not None
        confirms, producer, sender = self._parts
        confirms.new_batch()
        producer.new_batch()
        return confirms, sender

    def drop(self) -> None:
        """Forget the connection without a close handshake (a broken or blocked one never answers it)."""
        conn, self.conn = self.conn, None
        self._parts = None
        if conn is not None:
            try:
                conn.collect()
            except Exception:  # closing a dead connection must not hide what happened to the rows
                logger.debug("sweep: dropping the publishing connection failed", exc_info=True)

    def close(self) -> None:
        conn, self.conn = self.conn, None
        self._parts = None
        if conn is not None:
            try:
                conn.release()
            except Exception:
                logger.debug("sweep: closing the publishing connection failed", exc_info=True)


def _publish_batch_confirmed(
    session: _ConfirmSession,
    config: SafeTimeConfig,
    store: DelayStore,
    rows: list[DelayRow],
    token: str,
    stats: SweepStats,
    *,
    claimed_at: float,
    clock: Callable[[], float] = time.monotonic,
    marks: _Marks | None = None,
) -> None:
    """Publish in confirm mode, the batch written at once; mark sent only what RabbitMQ acknowledged.

    Every claimed row ends either sent (its publish was confirmed) or back to pending (not confirmed:
    nacked, the connection or channel died, the broker blocked publishing past the wait). A row
    handed back whose message did get through is published again by a later sweep; the delivery
    record runs it once.
    """
    app = session.app
    trusted_until = claimed_at + config.claim_timeout / 2
    confirm_wait = session.confirm_wait
    published: list[DelayRow] = []
    expired: list[str] = []
    handled: set[str] = set()
    error: BaseException | None = None
    confirms: PublisherConfirms | None = None
    try:
        confirms, sender = session.open()
        broker_errors = session.broker_errors
        for row in rows:
            if clock() > trusted_until:
                _abandon(store, config, [r for r in rows if r.id not in handled], token, stats)
                handled.update(r.id for r in rows)
                break
            confirms.current = row.id
            outcome = _publish_row(
                app, config, store, row, token, sender.producer, retry=False, broker_errors=broker_errors,
                send=sender.send_task,
            )  # fmt: skip
            handled.add(row.id)
            if outcome == C.STATUS_SENT:
                published.append(row)
            elif outcome == C.STATUS_EXPIRED:
                expired.append(row.id)
            else:
                stats.failed += 1
        sender.producer.flush()
        deadline = min(trusted_until, clock() + confirm_wait)
        while confirms.waiting:
            remaining = deadline - clock()
            try:
                # Past the deadline still read what already arrived (a sweeper paused while the acks
                # came in finds them in its socket), then stop at the first empty read.
                session.conn.drain_events(timeout=max(0.01, min(1.0, remaining)))
            except TimeoutError:  # socket.timeout: no answer yet
                if remaining <= 0:
                    break
    except session.broker_errors as exc:
        error = exc
    except BaseException:
        session.drop()
        raise
    confirmed = confirms.confirmed() if confirms is not None else set()
    sent = [row for row in published if row.id in confirmed]
    unconfirmed = [row.id for row in published if row.id not in confirmed]
    rest = [r.id for r in rows if r.id not in handled] + unconfirmed
    if error is not None or unconfirmed:
        session.drop()
    if rest:
        store.release(rest, token)
        logger.warning(
            "sweep: RabbitMQ confirmed %d of %d published stored delays (%s); %d claimed rows back to pending",
            len(sent),
            len(published),
            f"{error.__class__.__name__}: {error}" if error else f"no answer within {confirm_wait:g}s",
            len(rest),
        )
    if marks is not None and error is None:
        marks.submit(store, sent, expired, token, trusted_until)
    else:
        _finish(store, sent, expired, token, stats, max(0.0, trusted_until - clock()))
    if error is not None:
        # As on Redis: the broker is gone, the sweep fails (its rows are safe in the store).
        raise OperationalError(f"publishing stored delays: {error.__class__.__name__}: {error}") from error
    stats.unconfirmed += len(unconfirmed)


def _finish(
    store: DelayStore, sent: list[DelayRow], expired: list[str], token: str, stats: SweepStats, budget: float
) -> None:
    stats.sent += mark_sent_retrying(store, [r.id for r in sent], token, budget=budget)
    stats.expired += store.mark_expired(expired, token)
    for row in sent:
        signals.delay_released.send(sender=store, task_id=row.id, task_name=row.task, due_at=row.due_at)


def mark_sent_retrying(
    store: DelayStore,
    ids: list[str],
    token: str,
    *,
    budget: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Mark published rows sent, retrying a store error for up to ``budget`` seconds.

    Rows published but not marked stay claimed and are published again after the claim timeout;
    the delivery record's conditional start keeps that copy from running twice, and a store that is
    back within ``budget`` (what is left of half the claim timeout, counted from the claim, so nobody
    reclaims the rows meanwhile) never gets that far.
    """
    if not ids:
        return 0
    deadline = clock() + budget
    waits = iter(C.SWEEP_MARK_RETRY_DELAYS)
    tries = 0
    while True:
        try:
            marked = store.mark_sent(ids, token)
        except StoreError as exc:
            wait = next(waits, C.SWEEP_MARK_RETRY_DELAYS[-1])
            if clock() + wait > deadline:
                logger.error(
                    "sweep: published %d stored delays but could not mark them sent within %.0fs (%s); they are "
                    "re-published after the claim timeout and the delivery record runs each once: %s%s",
                    len(ids),
                    budget,
                    exc,
                    ", ".join(ids[:10]),
                    " ..." if len(ids) > 10 else "",
                )
                raise
            if tries == 0:
                logger.warning(
                    "sweep: published %d stored delays but could not mark them sent (%s); retrying for up to %.0fs",
                    len(ids),
                    exc,
                    budget,
                )
            tries += 1
            sleep(wait)
            continue
        if tries:
            logger.warning("sweep: marked %d published stored delays sent after %d retries", marked, tries)
        return marked


def _publish_row(
    app: Celery,
    config: SafeTimeConfig,
    store: DelayStore,
    row: DelayRow,
    token: str,
    producer: Any,
    *,
    retry: bool | None = None,
    broker_errors: tuple[type[BaseException], ...] = (OperationalError,),
    send: Callable[..., Any] | None = None,
) -> str:
    """Publish one claimed row; returns the status it should get. Bad rows are marked failed here.

    ``send``: ``app.send_task`` unless given (the RabbitMQ batch's :class:`~.amqp_batch.BatchSender`).
    """
    if row.expires_at is not None and row.claimed_at is not None and row.expires_at <= row.claimed_at:
        logger.info("stored task %s[%s] expired at %s; not sent", row.task, row.id, row.expires_at.isoformat())
        return C.STATUS_EXPIRED
    try:
        if row.task not in app.tasks:
            raise LookupError(f"unknown task {row.task!r} (not registered in this app)")
        body = decode(row.payload, row.content_type, row.content_encoding, allow_pickle=config.allow_pickle)
        options = dict(body.get("options") or {})
        headers = dict(options.pop("headers", None) or {})
        headers[C.HEADER_STORED] = row.due_at.isoformat()
        if row.delivery_token:
            headers[C.HEADER_DELIVERY] = row.delivery_token
        if retry is not None:
            options["retry"] = retry
        # Published under the caller's stored trace context (if any), so its trace continues here.
        in_stored_context(headers, send or app.send_task)(
            row.task,
            args=body.get("args") or (),
            kwargs=body.get("kwargs") or {},
            task_id=row.id,
            eta=row.due_at,
            expires=row.expires_at,
            producer=producer,
            headers=headers,
            add_to_parent=False,
            **options,
        )
    except broker_errors:
        raise
    except Exception as exc:  # one bad row must not stall the rows behind it
        # Unknown task, corrupt payload, options the publisher rejects (EncodeError, bad routing):
        # a row that failed once fails again, so it is parked as failed, never retried in a loop.
        error = f"{exc.__class__.__name__}: {exc}"
        logger.error("stored task %s[%s] cannot be published, marked failed: %s", row.task, row.id, error)
        store.mark_failed(row.id, token, error)
        signals.delay_failed.send(sender=store, task_id=row.id, task_name=row.task, error=error)
        return C.STATUS_FAILED
    return C.STATUS_SENT


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
