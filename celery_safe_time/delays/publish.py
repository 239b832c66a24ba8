"""Publishing a claimed batch: each row sent with ``eta=due_at`` (or marked expired / failed), then marked sent.

The per-row loop (:func:`publish_rows`) serves both brokers; RabbitMQ's confirm mode is in :mod:`.confirms`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Protocol

from celery import Celery
from kombu.exceptions import OperationalError

from .. import constants as C
from .. import signals
from ..config import SafeTimeConfig
from ..exceptions import StoreError
from ..messages.compat import BatchPublishError, native_delayed_delivery, routable_eta
from ..messages.publishing import PublishBatch, batched_publish
from .amqp_batch import BatchSender
from .backends.base import DelayRow, DelayStore
from .payload import decode
from .revoked import REASON_EXPIRED, report_revoked
from .sqs import fifo_properties
from .tracing import in_stored_context

logger = logging.getLogger(__name__)

#: After a sweep published a batch but could not mark it sent, it retries ``mark_sent`` with this
#: back-off for up to half of ``safe_time_claim_timeout`` (so no other sweeper reclaims the rows
#: meanwhile): a store that is back within that time never sees the rows published twice.
SWEEP_MARK_RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)
#: On RabbitMQ a sweep publishes a batch with publisher confirms and marks sent only the rows the
#: broker acknowledged; it waits at most this long (and never past half the claim timeout) for the
#: acks. Unconfirmed rows go back to pending (a memory alarm, a blocked or lost connection).
SWEEP_CONFIRM_TIMEOUT = 30.0


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


class MarkSink(Protocol):
    """Takes a published batch's rows to be marked sent (the sweep's :class:`~.sweep.Marks`, which
    marks in a thread while the next batch is published)."""

    def submit(
        self, store: DelayStore, sent: list[DelayRow], expired: list[DelayRow], token: str, trusted_until: float
    ) -> None: ...


@dataclasses.dataclass
class Batch:
    """One claimed batch on its way to the broker. ``published``, ``expired`` and ``handled`` are filled
    row by row, so they are exact when the publish loop stops on a broker error."""

    app: Celery
    config: SafeTimeConfig
    store: DelayStore
    rows: list[DelayRow]
    token: str
    stats: SweepStats
    #: Half the claim timeout after the claim (``clock``): later, another sweeper may have reclaimed the rows.
    trusted_until: float
    clock: Callable[[], float] = time.monotonic
    marks: MarkSink | None = None
    #: Rows handed to the broker (on RabbitMQ: not confirmed yet).
    published: list[DelayRow] = dataclasses.field(default_factory=list)
    #: Rows past their ``expires`` at the claim: marked expired (and reported revoked), not sent.
    expired: list[DelayRow] = dataclasses.field(default_factory=list)
    #: Ids of rows the loop is done with: published, expired, failed or abandoned.
    handled: set[str] = dataclasses.field(default_factory=set)

    def settle(self, sent: list[DelayRow], *, at_once: bool = False) -> None:
        """Mark ``sent`` sent and the expired rows expired: through ``marks`` unless ``at_once``."""
        if self.marks is not None and not at_once:
            self.marks.submit(self.store, sent, self.expired, self.token, self.trusted_until)
            return
        left = max(0.0, self.trusted_until - self.clock())
        store, stats = self.store, self.stats
        stats.sent += mark_sent_retrying(store, [r.id for r in sent], self.token, budget=left)
        closed = close_expired(store, self.expired, self.token)
        stats.expired += len(closed)
        for row in sent:
            signals.delay_released.send(sender=store, task_id=row.id, task_name=row.task, due_at=row.due_at)
        report_revoked(self.app, closed, REASON_EXPIRED, expired=True)

    def publish_rows(
        self,
        *,
        producer: Any,
        send: Callable[..., Any],
        retry: bool | None = None,
        broker_errors: tuple[type[BaseException], ...] = (OperationalError,),
        before: Callable[[DelayRow], None] | None = None,
    ) -> None:
        """Publish the rows one by one; a failed row is counted in ``stats`` (and marked failed).

        Past ``trusted_until`` the rows left are handed back to pending. ``before`` runs ahead of
        each row's publish (RabbitMQ: the row its publisher confirms are numbered for). Broker errors
        propagate.
        """
        rows, store, token = self.rows, self.store, self.token
        for index, row in enumerate(rows):
            if self.clock() > self.trusted_until:
                rest = [r.id for r in rows[index:]]
                self.stats.abandoned += len(rest)
                store.release(rest, token)
                self.handled.update(rest)
                logger.warning(
                    "sweep: publishing was slower than half the claim timeout (%gs); handing %d claimed rows "
                    "back instead of racing a sweeper that may have reclaimed them",
                    self.config.claim_timeout,
                    len(rest),
                )
                return
            if before is not None:
                before(row)
            status = publish_row(
                self.app, self.config, store, row, token, producer, retry=retry, broker_errors=broker_errors, send=send
            )
            self.handled.add(row.id)
            if status == C.STATUS_SENT:
                self.published.append(row)
            elif status == C.STATUS_EXPIRED:
                self.expired.append(row)
            elif status == C.STATUS_FAILED:
                self.stats.failed += 1


def publish_batch(batch: Batch) -> None:
    app, store, rows, token = batch.app, batch.store, batch.rows, batch.token
    publishing = PublishBatch()
    try:
        with _producer(app, batch.config) as producer, batched_publish(producer, len(rows), publishing):
            # send_task's per-row work with what a batch shares looked up once (see amqp_batch).
            batch.publish_rows(producer=producer, send=BatchSender(app, producer).send_task)
    except (OperationalError, BatchPublishError) as exc:
        # The broker is down: the rows not published go back to pending now, not after the claim
        # timeout. Batched, that is every row (nothing buffered went out, or which LPUSHes a failed
        # pipeline ran is unknown): the delivery record runs a row that arrives twice once.
        published = [] if publishing.active else batch.published
        done = {r.id for r in published} | {r.id for r in batch.expired}
        store.release([r.id for r in rows if r.id not in done], token)
        batch.settle(published, at_once=True)
        if isinstance(exc, BatchPublishError):
            raise OperationalError(f"publishing stored delays: {exc}: {exc.__cause__}") from exc
        raise
    if publishing.refused:
        batch.published = [r for r in batch.published if r.id not in publishing.refused]
        for task_id, error in publishing.refused.items():
            refuse(store, rows, task_id, token, error)
            batch.stats.failed += 1
    batch.settle(batch.published)


def refuse(store: DelayStore, rows: list[DelayRow], task_id: str, token: str, error: str) -> None:
    """Mark failed row ``task_id`` of ``rows``, whose message cannot be published (or the broker refused
    it for good in a batch)."""
    task = next((r.task for r in rows if r.id == task_id), "")
    logger.error("stored task %s[%s] cannot be published, marked failed: %s", task, task_id, error)
    store.mark_failed(task_id, token, error)
    signals.delay_failed.send(sender=store, task_id=task_id, task_name=task, error=error)


def publish_wait(config: SafeTimeConfig) -> float:
    """The longest a sweep waits for the broker on one publish (or a batch's confirms): a broker
    that stops answering leaves the rows to be published again, not a sweep that never returns."""
    return min(SWEEP_CONFIRM_TIMEOUT, config.claim_timeout / 4)


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


def close_expired(store: DelayStore, expired: list[DelayRow], token: str) -> list[DelayRow]:
    """Mark claimed rows expired, one conditional update each; returns the rows this claim closed.

    Row by row, so that exactly the rows this sweep closed are reported revoked: a row another
    sweeper reclaimed meanwhile is that sweeper's to close and report. A chord counts each report as
    one part of its header, so a row must never be reported twice.
    """
    return [row for row in expired if store.mark_expired([row.id], token)]


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
    waits = iter(SWEEP_MARK_RETRY_DELAYS)
    tries = 0
    while True:
        try:
            marked = store.mark_sent(ids, token)
        except StoreError as exc:
            wait = next(waits, SWEEP_MARK_RETRY_DELAYS[-1])
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


def publish_row(
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
    """Publish one claimed row; returns the status it should get. Bad rows are marked failed here; a
    row whose publish met a warning raised as an error goes back to pending here.

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
        if config.broker_kind == C.BROKER_SQS and row.delivery_token:
            call = (body.get("args") or (), body.get("kwargs") or {})
            options.update(fifo_properties(app, row.task, options, call, row.id, row.delivery_token))
        # Published under the caller's stored trace context (if any), so its trace continues here.
        in_stored_context(headers, send or app.send_task)(
            row.task,
            args=body.get("args") or (),
            kwargs=body.get("kwargs") or {},
            task_id=row.id,
            eta=_routable(app, producer, row.due_at),
            expires=row.expires_at,
            producer=producer,
            headers=headers,
            add_to_parent=False,
            **options,
        )
    except broker_errors:
        raise
    except Warning as exc:
        # A warning this process's filters raise as an error (``-W error``), such as Celery's
        # DuplicateTaskNameWarning when the lookup above finalizes the app: a fault of the process,
        # not of the row. The row goes back to pending for the next sweep; nothing is marked failed.
        # Should its message have gone out before the warning, the delivery record runs it once.
        logger.error(
            "stored task %s[%s] not published, back to pending: a warning raised as an error: %s: %s",
            row.task,
            row.id,
            exc.__class__.__name__,
            exc,
        )
        store.release([row.id], token)
        return C.STATUS_PENDING
    except Exception as exc:  # one bad row must not stall the rows behind it
        # Unknown task, corrupt payload, options the publisher rejects (EncodeError, bad routing):
        # a row that failed once fails again, so it is parked as failed, never retried in a loop.
        refuse(store, [row], row.id, token, f"{exc.__class__.__name__}: {exc}")
        return C.STATUS_FAILED
    return C.STATUS_SENT


def _routable(app: Celery, producer: Any, eta: datetime) -> datetime:
    """``eta`` as the broker can take it: on quorum queues, a row due in under a second goes out due in
    1.25 s (native delayed delivery cannot route less; the task runs that much late, never early)."""
    connection = getattr(producer, "connection", None)
    if connection is None or not native_delayed_delivery(app, connection.transport.driver_type):
        return eta
    return routable_eta(eta, datetime.now(timezone.utc))
