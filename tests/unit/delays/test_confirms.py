"""PublisherConfirms' bookkeeping (the broker side is tests/integration/delays/test_rabbitmq.py)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from celery_safe_time.delays.confirms import PublisherConfirms


class Channel:
    """Just what PublisherConfirms touches on a py-amqp channel: confirm_select, events, basic_publish."""

    def __init__(self) -> None:
        self.events: defaultdict[str, set[Any]] = defaultdict(set)
        self.selected = False
        self.frames: list[str] = []

    def confirm_select(self) -> None:
        self.selected = True

    def basic_publish(self, body: str, **_: Any) -> None:
        self.frames.append(body)

    def answer(self, kind: str, tag: int, multiple: bool = False) -> None:
        for callback in list(self.events[kind]):
            callback(tag, multiple)


def publish(confirms: PublisherConfirms, channel: Channel, *ids: str) -> None:
    for row_id in ids:
        confirms.current = row_id
        channel.basic_publish(row_id)


def test_numbers_publishes_and_settles_single_and_multiple_acks() -> None:
    channel = Channel()
    confirms = PublisherConfirms(channel)
    assert channel.selected
    publish(confirms, channel, "a", "b", "c", "d")
    assert channel.frames == ["a", "b", "c", "d"]  # the wrapper still publishes
    assert confirms.waiting
    channel.answer("basic_ack", 2, multiple=True)  # a and b
    assert confirms.confirmed() == {"a", "b"}
    channel.answer("basic_ack", 4)  # d alone
    assert confirms.confirmed() == {"a", "b", "d"}
    assert confirms.waiting  # c still open
    channel.answer("basic_nack", 3)
    assert not confirms.waiting
    assert confirms.confirmed() == {"a", "b", "d"}


def test_a_row_that_never_reached_the_channel_does_not_shift_the_numbering() -> None:
    channel = Channel()
    confirms = PublisherConfirms(channel)
    publish(confirms, channel, "a")
    confirms.current = "bad"  # fails before its publish (an encode error): no frame, no number
    publish(confirms, channel, "c")
    channel.answer("basic_ack", 2, multiple=True)
    assert confirms.confirmed() == {"a", "c"}


def test_a_multiple_nack_leaves_the_earlier_acks_and_repeated_answers_are_harmless() -> None:
    channel = Channel()
    confirms = PublisherConfirms(channel)
    publish(confirms, channel, "a", "b", "c")
    channel.answer("basic_ack", 1)
    channel.answer("basic_nack", 3, multiple=True)  # b and c
    channel.answer("basic_ack", 3, multiple=True)  # nothing left to settle
    assert confirms.confirmed() == {"a"}
    assert not confirms.waiting
