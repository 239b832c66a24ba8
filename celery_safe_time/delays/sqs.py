"""SQS rules for stored calls: the message size limit at the call site, FIFO properties at publish.

A stored call's message is checked against SQS's 256 KiB limit when it is stored: SQS would refuse
it only at publish, in a sweep long after the caller is gone. On a FIFO queue (a name ending in
``.fifo``) the sweep publishes each row with a ``MessageDeduplicationId`` derived from its delivery
token, the same for every copy of one delivery, so a copy published again within SQS's 5-minute
deduplication window is dropped by SQS itself; each row is a message group of its own (stored calls
keep no order among themselves, and one group would let a single held message stall the rest).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

from celery import Celery

from .. import constants as C
from ..exceptions import SerializationError

#: What kombu wraps around a task's body on SQS (headers, properties, delivery info), allowed for when
#: a stored call's message size is checked at the call site.
SQS_ENVELOPE_BYTES = 2048

#: The kombu message properties SQS's transport reads for a FIFO queue.
GROUP_PROPERTY = "MessageGroupId"
DEDUPLICATION_PROPERTY = "MessageDeduplicationId"


def _base64_length(n: int) -> int:
    return 4 * math.ceil(n / 3)


def message_bytes(payload_bytes: int, transport_options: Mapping[str, Any]) -> int:
    """The size of the SQS message a stored call of ``payload_bytes`` becomes: kombu base64-encodes the
    task's body into its JSON envelope, and (unless ``sqs_base64_encoding`` is False) the whole
    envelope once more."""
    inner = _base64_length(payload_bytes) + SQS_ENVELOPE_BYTES
    return _base64_length(inner) if transport_options.get("sqs_base64_encoding", True) else inner


def message_limit(transport_options: Mapping[str, Any]) -> int:
    """The largest message the queues take: the ``MaximumMessageSize`` the transport creates them with
    (``sqs-creation-attributes``), else 256 KiB, the limit of every queue created before SQS raised its
    maximum to 1 MiB and of any queue left at it."""
    attributes = transport_options.get("sqs-creation-attributes") or {}
    try:
        return int(attributes.get("MaximumMessageSize", C.SQS_MAX_MESSAGE_BYTES))
    except (TypeError, ValueError):
        return C.SQS_MAX_MESSAGE_BYTES


def check_message_size(app: Celery, task_name: str, payload_bytes: int) -> None:
    """Raise :class:`~celery_safe_time.exceptions.SerializationError` (nothing stored) when the
    message of a stored call would be larger than its SQS queue takes."""
    options = app.conf.broker_transport_options or {}
    size, limit = message_bytes(payload_bytes, options), message_limit(options)
    if size > limit:
        raise SerializationError(
            f"the message of {task_name} would be about {size} bytes, above the SQS message size limit "
            f"({limit} bytes; broker_transport_options['sqs-creation-attributes']['MaximumMessageSize'] "
            "sets it, default 262144: 256 KiB): not stored; pass a reference to the data (a database key, "
            "an object store URL) instead of the data"
        )


def deduplication_id(task_id: str, delivery_token: str) -> str:
    """One delivery's ``MessageDeduplicationId``: the same for every copy of it (at most 128 characters
    of SQS's alphabet, whatever the task id holds)."""
    return hashlib.sha256(f"{task_id}\0{delivery_token}".encode()).hexdigest()


def fifo_properties(
    app: Celery,
    task_name: str,
    options: Mapping[str, Any],
    call: tuple[Any, Any],
    task_id: str,
    token: str,
) -> dict[str, Any]:
    """The FIFO properties of a stored row's message when it is routed to a ``.fifo`` queue, else none
    (``call``: the row's args and kwargs, for routers that look at them). A ``MessageGroupId`` the
    caller set is kept."""
    args, kwargs = call
    route = app.amqp.router.route(dict(options), task_name, args, kwargs)
    queue = route.get("queue")
    name = getattr(queue, "name", queue)
    if not isinstance(name, str) or not name.endswith(".fifo"):
        return {}
    properties: dict[str, Any] = {DEDUPLICATION_PROPERTY: deduplication_id(task_id, token)}
    if GROUP_PROPERTY not in options:
        properties[GROUP_PROPERTY] = task_id
    return properties
