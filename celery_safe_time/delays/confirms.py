"""RabbitMQ publisher confirms for the sweep: one connection in confirm mode per sweep, a batch written at
once and marked sent only for what RabbitMQ acknowledged."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError

from ..config import SafeTimeConfig
from .amqp_batch import BatchProducer, BatchSender
from .backends.base import DelayRow
from .publish import Batch, publish_wait

logger = logging.getLogger(__name__)


class PublisherConfirms:
    """Publisher confirms on one AMQP channel, tracked per publish.

    In confirm mode RabbitMQ numbers the channel's publishes 1, 2, 3, ... and answers each with
    ``basic.ack`` once it has taken responsibility for the message (routed to its queues, on disk for
    durable ones) or ``basic.nack``; one answer may settle every number up to its own (``multiple``).
    Waiting for each answer before the next publish (kombu's ``confirm_publish``) costs a round trip
    per row (several times slower: docs/benchmarks.md), so a batch is published first and its answers
    collected after.
    Publishes are numbered where they really happen, so a row that fails before (or, through a
    signal handler, after) its publish cannot shift the count: :meth:`number` for the ones the
    sweep's :class:`~.amqp_batch.BatchProducer` buffers, and a wrapper of the channel's
    ``basic_publish`` for any other (which writes what is buffered first: the order is the numbering).
    """

    def __init__(self, channel: Any) -> None:
        channel.confirm_select()
        channel.events["basic_ack"].add(functools.partial(self._settle, acked=True))
        channel.events["basic_nack"].add(functools.partial(self._settle, acked=False))
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


class ConfirmSession:
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
        self._let_go("dropping", lambda conn: conn.collect())

    def close(self) -> None:
        self._let_go("closing", lambda conn: conn.release())

    def _let_go(self, how: str, end: Callable[[Any], object]) -> None:
        conn, self.conn = self.conn, None
        self._parts = None
        if conn is not None:
            try:
                end(conn)
            except Exception:  # closing a dead connection must not hide what happened to the rows
                logger.debug("sweep: %s the publishing connection failed", how, exc_info=True)


def publish_batch_confirmed(session: ConfirmSession, batch: Batch) -> None:
    """Publish in confirm mode, the batch written at once; mark sent only what RabbitMQ acknowledged.

    Every claimed row ends either sent (its publish was confirmed) or back to pending (not confirmed:
    nacked, the connection or channel died, the broker blocked publishing past the wait). A row
    handed back whose message did get through is published again by a later sweep; the delivery
    record runs it once.
    """
    clock, confirm_wait = batch.clock, session.confirm_wait
    error: BaseException | None = None
    confirms: PublisherConfirms | None = None
    try:
        confirms, sender = session.open()
        tracked = confirms

        def track(row: DelayRow) -> None:
            tracked.current = row.id  # the row the channel's next publish numbers belong to

        batch.publish_rows(
            producer=sender.producer,
            send=sender.send_task,
            retry=False,
            broker_errors=session.broker_errors,
            before=track,
        )
        sender.producer.flush()
        deadline = min(batch.trusted_until, clock() + confirm_wait)
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
    published = batch.published
    sent = [row for row in published if row.id in confirmed]
    unconfirmed = [row.id for row in published if row.id not in confirmed]
    rest = [r.id for r in batch.rows if r.id not in batch.handled] + unconfirmed
    if error is not None or unconfirmed:
        session.drop()
    if rest:
        batch.store.release(rest, batch.token)
        logger.warning(
            "sweep: RabbitMQ confirmed %d of %d published stored delays (%s); %d claimed rows back to pending",
            len(sent),
            len(published),
            f"{error.__class__.__name__}: {error}" if error else f"no answer within {confirm_wait:g}s",
            len(rest),
        )
    batch.settle(sent, at_once=error is not None)
    if error is not None:
        # As on Redis: the broker is gone, the sweep fails (its rows are safe in the store).
        raise OperationalError(f"publishing stored delays: {error.__class__.__name__}: {error}") from error
    batch.stats.unconfirmed += len(unconfirmed)
