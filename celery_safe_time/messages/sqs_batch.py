"""Batched publishing to SQS: a batch's messages sent with ``SendMessageBatch``, 10 per call.

Within :func:`sqs_batched_publish` every message still goes through ``send_task`` and kombu's ``_put``
(queue creation, FIFO ids, delay, body): only the final ``send_message`` call is recorded instead of
made, and the records go out per queue when the block ends. An entry SQS refuses as the sender's
fault is handed back (``refused``: the sweep marks that row failed); a call refused whole that way
is sent again one message at a time. Any other failure raises kombu's ``BatchPublishError``: which
messages SQS kept is unknown, so the sweep hands the whole batch back (the delivery record runs a row
that arrives twice once).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import constants as C
from .compat import BatchPublishError

logger = logging.getLogger(__name__)

#: SQS takes at most this many entries in one ``SendMessageBatch`` call.
SQS_BATCH_ENTRIES = 10


class _Recorder:
    """Stands in for the boto3 SQS client in kombu's ``_put``: records ``send_message`` calls; any
    other call goes to the real client."""

    def __init__(self, client: Any, sink: list[tuple[Any, dict[str, Any]]]) -> None:
        self._client = client
        self._sink = sink

    def send_message(self, **kwargs: Any) -> None:
        self._sink.append((self._client, kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def is_sqs(producer: Any) -> bool:
    """Whether ``producer`` publishes through kombu's SQS transport."""
    connection = getattr(producer, "connection", None)
    transport = getattr(connection, "transport", None)
    return getattr(transport, "driver_type", None) == "sqs"


def chunks(
    requests: list[dict[str, Any]], limit_bytes: int = C.SQS_MAX_MESSAGE_BYTES
) -> Iterator[list[dict[str, Any]]]:
    """``requests`` (one queue's) in ``SendMessageBatch`` calls: at most 10 entries and, past the
    first entry, at most ``limit_bytes`` of message bodies."""
    batch: list[dict[str, Any]] = []
    size = 0
    for request in requests:
        body = len(request.get("MessageBody", ""))
        if batch and (len(batch) == SQS_BATCH_ENTRIES or size + body > limit_bytes):
            yield batch
            batch, size = [], 0
        batch.append(request)
        size += body
    if batch:
        yield batch


def task_id_of(body: str) -> str:
    """The Celery task id in an SQS message body (kombu's JSON message, base64-encoded or not)."""
    try:
        message = json.loads(body)
    except ValueError:
        message = json.loads(base64.b64decode(body))
    return str(message["headers"]["id"])


def send_batches(recorded: list[tuple[Any, dict[str, Any]]], refused: dict[str, str]) -> int:
    """Send the recorded ``send_message`` requests in ``SendMessageBatch`` calls; returns how many
    calls. Entries refused as the sender's fault go into ``refused`` (task id -> error); a failed
    call or another failed entry raises ``BatchPublishError``."""
    from botocore.exceptions import BotoCoreError, ClientError

    by_queue: dict[str, tuple[Any, list[dict[str, Any]]]] = {}
    for client, kwargs in recorded:
        by_queue.setdefault(kwargs["QueueUrl"], (client, []))[1].append(kwargs)
    calls = 0
    for url, (client, requests) in by_queue.items():
        for batch in chunks(requests):
            entries = [
                {"Id": str(i), **{k: v for k, v in request.items() if k != "QueueUrl"}}
                for i, request in enumerate(batch)
            ]
            try:
                response = client.send_message_batch(QueueUrl=url, Entries=entries)
            except ClientError as exc:
                if not _sender_fault(exc):
                    raise BatchPublishError(f"SendMessageBatch to {url} failed: {exc}") from exc
                # The whole call refused for one entry's sake (a message larger than the queue takes):
                # one by one, the others go out and the bad one is refused on its own.
                calls += _one_by_one(client, batch, refused)
                continue
            except BotoCoreError as exc:
                raise BatchPublishError(f"SendMessageBatch to {url} failed: {exc}") from exc
            calls += 1
            failed = []
            for entry in response.get("Failed") or []:
                if entry.get("SenderFault"):
                    request = batch[int(entry["Id"])]
                    error = f"SQS refused the message: {entry.get('Code')}: {entry.get('Message')}"
                    refused[task_id_of(request["MessageBody"])] = error
                else:
                    failed.append(entry)
            if failed:
                first = failed[0]
                raise BatchPublishError(
                    f"SendMessageBatch to {url}: {len(failed)} of {len(entries)} entries failed "
                    f"(first: {first.get('Code')}: {first.get('Message')})"
                )
    return calls


def _sender_fault(exc: Any) -> bool:
    """Whether SQS refused a request as the sender's fault (HTTP 400): the same request fails again."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return bool(status == 400)


def _one_by_one(client: Any, batch: list[dict[str, Any]], refused: dict[str, str]) -> int:
    """Send ``batch``'s requests one ``SendMessage`` each; a request refused as the sender's fault
    goes into ``refused``, any other error raises ``BatchPublishError``. Returns how many calls."""
    from botocore.exceptions import BotoCoreError, ClientError

    for request in batch:
        try:
            client.send_message(**request)
        except ClientError as exc:
            if not _sender_fault(exc):
                raise BatchPublishError(f"SendMessage to {request['QueueUrl']} failed: {exc}") from exc
            refused[task_id_of(request["MessageBody"])] = f"SQS refused the message: {exc}"
        except BotoCoreError as exc:
            raise BatchPublishError(f"SendMessage to {request['QueueUrl']} failed: {exc}") from exc
    return len(batch)


@contextmanager
def sqs_batched_publish(producer: Any, refused: dict[str, str]) -> Iterator[None]:
    """Record the block's SQS publishes and send them in batches when it ends (nothing is sent when
    the block raises); the task ids of messages refused for good go into ``refused``."""
    channel = producer.channel
    recorded: list[tuple[Any, dict[str, Any]]] = []
    real_sqs = channel.sqs

    def recording_sqs(queue: Any = None) -> _Recorder:
        return _Recorder(real_sqs(queue=queue), recorded)

    channel.sqs = recording_sqs
    try:
        yield
    finally:
        # Back to the class's method: the pooled channel must not keep this batch's state.
        del channel.sqs
    if recorded:
        calls = send_batches(recorded, refused)
        logger.debug("published %d messages to SQS in %d SendMessageBatch calls", len(recorded), calls)
