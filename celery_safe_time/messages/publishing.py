"""Publishing many messages at once through Celery: the sweep's batches and a beat tick's due slots.

On Redis, kombu's ``Producer.batch`` sends the publishes of a block in one pipeline round trip; on
SQS, :mod:`.sqs_batch` sends them in ``SendMessageBatch`` calls of 10; every message still goes
through Celery's ``send_task`` (routing, headers, ``before/after_task_publish``). Other transports
publish one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .randomness import uuid4_str
from .sqs_batch import is_sqs, sqs_batched_publish


class PublishBatch:
    """Whether this batch's publishes are buffered (sent at the end) or went out one by one."""

    active = False

    def __init__(self) -> None:
        #: Task id -> error, for the messages the broker refused for good (SQS: a sender fault, such
        #: as a message larger than the queue takes); the rest of the batch went out.
        self.refused: dict[str, str] = {}


def publishes_in_batches(producer: Any) -> bool:
    """Whether :func:`batched_publish` sends a batch in fewer round trips than one per message on
    ``producer``'s transport (Redis: one pipeline; SQS: ``SendMessageBatch``, 10 per call)."""
    return is_sqs(producer) or bool(getattr(producer, "supports_batch_publish", False))


@contextmanager
def batched_publish(producer: Any, rows: int, state: PublishBatch) -> Iterator[None]:
    """Buffer a batch's publishes and send them in one round trip where the transport can (see the module).

    On Redis the LPUSHes ``publish`` would run go in one pipeline, executed when the block ends; the
    binding table of a routed exchange (one SMEMBERS per message) is read, and each queue declared,
    once per batch.
    """
    if is_sqs(producer):
        state.active = True
        with sqs_batched_publish(producer, state.refused):
            yield
        return
    if not getattr(producer, "supports_batch_publish", False):
        yield
        return
    channel = producer.channel
    tables: dict[str, Any] = {}
    read_table = channel.get_table

    def get_table(exchange: str) -> Any:
        if exchange not in tables:
            tables[exchange] = read_table(exchange)
        return tables[exchange]

    declared: dict[int, Any] = {}
    declare = producer.maybe_declare

    def maybe_declare(entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        # kombu binds a copy of the queue for every message before finding it in its declared cache;
        # an entity already declared in this batch is declared (the same object, the same channel).
        if id(entity) not in declared:
            declare(entity, retry, **retry_policy)
            declared[id(entity)] = entity  # keeps the object, so its id is not reused meanwhile
        return False

    channel.get_table = get_table
    producer.maybe_declare = maybe_declare
    # kombu's delivery tag (its key in the unacked hash on Redis): the same str(uuid4()) form, drawn
    # from a block of random bytes instead of one getrandom per message, a call that lets the GIL go
    # (see celery_safe_time.messages.randomness).
    channel._next_delivery_tag = uuid4_str
    state.active = True
    try:
        # Room for each message's LPUSH and the PEXPIREs of a queue with x-expires: one flush at the end.
        with producer.batch(max_size=max(1, rows) * (1 + len(getattr(channel, "priority_steps", ())))):
            yield
    finally:
        # Back to the classes' methods: the pooled producer and channel must not keep this batch's state.
        del channel.get_table
        del channel._next_delivery_tag
        del producer.maybe_declare
