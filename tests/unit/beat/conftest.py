"""What the beat unit tests share: a clock they move by hand, an app that reaches no server, one
in-memory beat backend for every scheduler a test makes, and a hook on each slot a leader publishes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import signals
from celery_safe_time.beat import base as beat_base
from celery_safe_time.beat import history
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData

#: What the ``on_dispatched`` fixture is: it connects a ``beat_slot_dispatched`` receiver for one test.
OnDispatched = Callable[[Callable[..., None]], None]

T0 = 1_800_000_000.0  # a whole minute: the first slot of a 1 s grid and of a 60 s one


class FakeTime:
    """The injected clock: ``now`` is set (advanced) by the test."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def memory_app(main: str, **conf: Any) -> Celery:
    """An app that reaches no server (its beat backend is the ``data`` fixture's); ``conf`` adds to its
    settings or overrides them."""
    app = Celery(main, set_as_current=False)
    app.conf.update(
        {
            "broker_url": "memory://",
            "safe_time_redis_url": "redis://127.0.0.1:1/0",  # never connected: the backends are in memory
            "safe_time_store_url": "memory://",
            "safe_time_beat_lease": 30,
            "timezone": "UTC",
            **conf,
        }
    )
    return app


@pytest.fixture
def clock() -> FakeTime:
    return FakeTime()


@pytest.fixture
def data(clock: FakeTime, monkeypatch: pytest.MonkeyPatch) -> MemoryBeatData:
    """One shared in-memory backend for every scheduler (and history lookup) this test makes."""
    shared = MemoryBeatData(now=clock)
    monkeypatch.setattr(beat_base, "beat_backend", lambda config: MemoryBeatBackend(config, shared))
    monkeypatch.setattr(history, "beat_backend", lambda config: MemoryBeatBackend(config, shared))
    history._backends.clear()  # history caches a backend per app: none is left from an earlier test
    return shared


@pytest.fixture
def on_dispatched() -> Iterator[OnDispatched]:
    """Connects a receiver to ``beat_slot_dispatched`` for this test: ``on_dispatched(receiver)``."""
    receivers: list[Callable[..., None]] = []

    def connect(receiver: Callable[..., None]) -> None:
        signals.beat_slot_dispatched.connect(receiver, weak=False)
        receivers.append(receiver)

    yield connect
    for receiver in receivers:
        signals.beat_slot_dispatched.disconnect(receiver)
