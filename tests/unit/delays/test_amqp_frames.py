"""FrameEncoder writes what py-amqp's frame writer writes, byte for byte (the broker side is
tests/integration/delays/test_rabbitmq_batch.py)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from amqp import spec
from amqp.basic_message import Message
from amqp.method_framing import frame_writer
from amqp.serialization import dumps

from celery_safe_time.delays.amqp_batch import FrameEncoder


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))


class Connection:
    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self.bytes_sent = 0


def py_amqp_frames(channel: int, frame_max: int, body: bytes, properties: dict[str, Any], **method: Any) -> bytes:
    transport = Transport()
    write = frame_writer(Connection(frame_max), transport)
    args = dumps(
        "Bssbb",
        (0, method.get("exchange", ""), method["routing_key"], method.get("mandatory"), method.get("immediate")),
    )
    write(1, channel, spec.Basic.Publish, args, Message(body, **properties))
    return b"".join(transport.written)


CELERY_HEADERS: dict[str, Any] = {
    "lang": "py",
    "task": "tests.delays.record",
    "id": "row-001",
    "shadow": None,
    "eta": "2026-12-01T14:00:00+00:00",
    "expires": None,
    "group": None,
    "group_index": None,
    "retries": 0,
    "timelimit": [None, None],
    "root_id": "row-001",
    "parent_id": None,
    "argsrepr": "('x',)",
    "kwargsrepr": "{}",
    "origin": "gen1@host",
    "ignore_result": False,
    "replaced_task_nesting": 0,
    "stamped_headers": None,
    "stamps": {},
    "safe_time_stored": "2026-12-01T14:00:00+00:00",
    "unicode": "zürich ✓",
    "ratio": 0.5,
    "big": 2**40,
    "nested": {"a": [1, "b", {"c": True}], "d": None},
    "flag": True,
}


@pytest.mark.parametrize(
    "properties",
    [
        {"content_type": "application/json", "content_encoding": "utf-8", "application_headers": CELERY_HEADERS,
         "delivery_mode": 2, "priority": 7, "correlation_id": "row-001", "reply_to": "reply.oid"},
        {"delivery_mode": 1},
        {"application_headers": {}, "expiration": "1500", "message_id": "m", "type": "t", "user_id": "guest",
         "app_id": "a", "timestamp": 1764597600},
        {},
    ],
)  # fmt: skip
def test_the_frames_of_one_publish_match_py_amqp(properties: dict[str, Any]) -> None:
    body = b'[["x"], {}, {"callbacks": null}]'
    encoder = FrameEncoder(3, 131072)
    ours = encoder.publish(body, dict(properties), exchange="ex", routing_key="celery")
    assert ours == py_amqp_frames(3, 131072, body, dict(properties), exchange="ex", routing_key="celery")


def test_a_body_larger_than_a_frame_is_split_as_py_amqp_splits_it() -> None:
    body = bytes(range(256)) * 40  # 10,240 bytes over 4,096-byte frames
    encoder = FrameEncoder(1, 4096)
    ours = encoder.publish(body, {"delivery_mode": 2}, exchange="", routing_key="q", mandatory=True)
    assert ours == py_amqp_frames(1, 4096, body, {"delivery_mode": 2}, routing_key="q", mandatory=True)


def test_items_reused_across_a_batch_keep_their_types_and_values_apart() -> None:
    """1 and True, [None, None] and [0, 0], one id and the next: the memo never swaps them."""
    encoder = FrameEncoder(1, 131072)
    variants: list[dict[str, Any]] = [
        {"id": "a", "retries": 1, "timelimit": [None, None], "stamps": {}},
        {"id": "b", "retries": True, "timelimit": [0, 0], "stamps": {"k": "v"}},
        {"id": "a", "retries": 1.0, "timelimit": [False, False], "stamps": {}},
        {"id": "a", "retries": 1, "timelimit": (None, None), "stamps": {}},
    ]
    for headers in variants * 2:  # the second round comes from the memo
        properties = {"application_headers": headers, "delivery_mode": 2}
        expected = py_amqp_frames(1, 131072, b"{}", dict(properties), routing_key="celery")
        assert encoder.publish(b"{}", properties, exchange="", routing_key="celery") == expected


def test_a_timestamp_property_and_a_datetime_header_match_py_amqp() -> None:
    when = datetime(2026, 12, 1, 14, 0, tzinfo=timezone.utc)
    properties = {"application_headers": {"at": when}, "timestamp": 1764597600}
    ours = FrameEncoder(2, 131072).publish(b"", dict(properties), exchange="", routing_key="r")
    assert ours == py_amqp_frames(2, 131072, b"", dict(properties), routing_key="r")


def test_a_routing_key_over_255_bytes_is_refused_before_anything_is_buffered() -> None:
    with pytest.raises(ValueError, match="short string"):
        FrameEncoder(1, 131072).publish(b"", {}, exchange="", routing_key="q" * 256)


def test_one_encoder_publishing_to_several_destinations_keeps_each_method_frame_apart() -> None:
    encoder = FrameEncoder(1, 131072)
    for exchange, routing_key, mandatory in [("", "celery", False), ("ex", "rk", False), ("", "celery", True)] * 2:
        expected = py_amqp_frames(1, 131072, b"{}", {}, exchange=exchange, routing_key=routing_key, mandatory=mandatory)
        ours = encoder.publish(b"{}", {}, exchange=exchange, routing_key=routing_key, mandatory=mandatory)
        assert ours == expected


PLAIN_REPR_CASES: list[Any] = [
    (),
    ["x"],
    ("x", 1, 2.5, None, True, False, -0.0, 10**30, float("inf")),
    {},
    {"b": 1, "a": "z", "c": None},
    ["it's"],  # a quote: saferepr quotes it its own way
    ['say "hi"'],
    ["back\\slash"],
    ["new\nline"],
    ["é"],
    [[1, 2]],  # nested: saferepr's depth and size rules apply
    {"k": {"n": 1}},
    {1: "int key"},
    ["a" * 600],  # near the size limit: saferepr may truncate
    ["a" * 2000],
    [b"bytes"],
    [object()],
]


@pytest.mark.parametrize("value", PLAIN_REPR_CASES)
def test_plain_repr_is_celerys_saferepr_or_declines(value: Any) -> None:
    from celery.utils.saferepr import saferepr

    from celery_safe_time.delays.amqp_batch import plain_repr

    got = plain_repr(value, 1024)
    if got is not None:
        assert got == saferepr(value, 1024, maxlevels=3)
    # what it must take: the flat, short, plain values a stored delay's arguments mostly are
    plain = value in ((), ["x"], {}, {"b": 1, "a": "z", "c": None}) or (isinstance(value, tuple) and len(value) == 9)
    assert (got is not None) == plain
