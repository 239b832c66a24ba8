"""SQS rules for stored calls (issue 42): the message size estimate and limit, and the FIFO properties."""

from __future__ import annotations

import base64
import json

import pytest
from celery import Celery

from celery_safe_time.delays.sqs import (
    SQS_ENVELOPE_BYTES,
    check_message_size,
    deduplication_id,
    fifo_properties,
    message_bytes,
    message_limit,
)
from celery_safe_time.exceptions import SerializationError
from celery_safe_time.messages.sqs_batch import chunks, task_id_of


def test_the_estimate_covers_kombus_two_base64_layers() -> None:
    payload = 100_000
    inner = len(base64.b64encode(b"x" * payload)) + SQS_ENVELOPE_BYTES
    assert message_bytes(payload, {}) == len(base64.b64encode(b"x" * inner))
    assert message_bytes(payload, {"sqs_base64_encoding": False}) == inner


def test_the_limit_is_the_queues_maximum_message_size_else_256_kib() -> None:
    assert message_limit({}) == 262144
    assert message_limit({"sqs-creation-attributes": {"MaximumMessageSize": "1048576"}}) == 1048576


def test_a_call_over_the_limit_is_refused_naming_it() -> None:
    app = Celery("sqs-unit", broker="sqs://k:s@", set_as_current=False)
    check_message_size(app, "t", 140_000)
    with pytest.raises(SerializationError, match=r"SQS message size limit \(262144 bytes"):
        check_message_size(app, "t", 150_000)
    app.conf.broker_transport_options = {"sqs-creation-attributes": {"MaximumMessageSize": 1048576}}
    check_message_size(app, "t", 150_000)


def test_the_deduplication_id_is_one_per_delivery_and_fits_sqs() -> None:
    one = deduplication_id("task-1", "token-a")
    assert one == deduplication_id("task-1", "token-a")
    assert one not in {deduplication_id("task-1", "token-b"), deduplication_id("task-2", "token-a")}
    assert len(one) <= 128
    assert one.isalnum()
    assert len(deduplication_id("ünïcode id " * 40, "t")) == 64


@pytest.mark.parametrize(
    ("default_queue", "options", "expected_group"),
    [
        ("celery", {}, None),
        ("jobs.fifo", {}, "task-1"),
        ("celery", {"queue": "jobs.fifo"}, "task-1"),
        ("jobs.fifo", {"MessageGroupId": "tenant-7"}, "kept"),
    ],
)
def test_fifo_properties_follow_the_route_of_the_message(
    default_queue: str, options: dict[str, str], expected_group: str | None
) -> None:
    app = Celery("sqs-unit", broker="sqs://k:s@", set_as_current=False)
    app.conf.task_default_queue = default_queue
    props = fifo_properties(app, "tests.t", options, ((), {}), "task-1", "token")
    if expected_group is None:
        assert props == {}
        return
    assert props["MessageDeduplicationId"] == deduplication_id("task-1", "token")
    if expected_group == "kept":
        assert "MessageGroupId" not in props
    else:
        assert props["MessageGroupId"] == expected_group
    json.dumps(props)


def test_batches_hold_at_most_ten_entries_and_one_message_of_payload() -> None:
    requests = [{"MessageBody": "x" * 100} for _ in range(25)]
    assert [len(b) for b in chunks(requests)] == [10, 10, 5]
    big = [{"MessageBody": "x" * 100_000} for _ in range(5)]
    assert [len(b) for b in chunks(big)] == [2, 2, 1]
    assert [len(b) for b in chunks([{"MessageBody": "x" * 300_000}, {"MessageBody": "y"}])] == [1, 1]


def test_the_task_id_is_read_from_a_message_body_base64_or_not() -> None:
    message = json.dumps({"body": "", "headers": {"id": "task-9"}})
    assert task_id_of(message) == "task-9"
    assert task_id_of(base64.b64encode(message.encode()).decode()) == "task-9"
