"""Pure rules of durable delays: when to store, time normalisation, payload encoding."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from celery import Celery
from kombu import Exchange, Queue

from celery_safe_time import constants as C
from celery_safe_time.clock import UTC, as_utc
from celery_safe_time.config import get_config
from celery_safe_time.delays.backends.base import NewDelay
from celery_safe_time.delays.payload import clean_options, decode, encode
from celery_safe_time.delays.plan import plan_delay
from celery_safe_time.delays.sweep import register
from celery_safe_time.exceptions import SerializationError

NOW = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)


def test_plan_delay_threshold_countdown_and_eta() -> None:
    assert plan_delay(None, None, now=NOW, threshold=900) is None
    assert plan_delay(900, None, now=NOW, threshold=900) is None
    plan = plan_delay(901, None, now=NOW, threshold=900)
    assert plan is not None
    assert plan.countdown == 901
    # countdown wins over eta, as in Celery
    assert plan_delay(5, NOW + timedelta(days=1), now=NOW, threshold=900) is None
    eta = NOW + timedelta(hours=2)
    plan = plan_delay(None, eta, now=NOW, threshold=900)
    assert plan is not None
    assert plan.eta == eta
    assert plan_delay(None, NOW - timedelta(hours=1), now=NOW, threshold=900) is None
    assert plan_delay(0.5, None, now=NOW, threshold=0) is not None


def test_naive_and_string_times_follow_celery() -> None:
    naive = datetime(2026, 3, 8, 9, 0)
    assert as_utc(naive) == naive.replace(tzinfo=UTC)
    assert as_utc("2026-03-08T10:00:00+01:00") == naive.replace(tzinfo=UTC)
    plan = plan_delay(None, "2026-03-08T09:00:00", now=NOW, threshold=60)
    assert plan is not None
    assert plan.eta == naive.replace(tzinfo=UTC)
    with pytest.raises(TypeError):
        as_utc(12)  # type: ignore[arg-type]


def test_new_delay_resolves_relative_times_on_the_store_clock() -> None:
    base = {"id": "x", "task": "t", "payload": b"", "content_type": "application/json", "content_encoding": "utf-8"}
    assert NewDelay(**base, countdown=60, expires_in=1.5).resolve(NOW) == (
        NOW + timedelta(seconds=60),
        NOW + timedelta(seconds=1.5),
    )
    when = datetime(2026, 3, 9, tzinfo=UTC)
    assert NewDelay(**base, due_at=when, expires_at=when).resolve(NOW) == (when, when)
    with pytest.raises(ValueError, match="due_at or countdown"):
        NewDelay(**base).resolve(NOW)


def test_clean_options_drops_live_objects_and_internal_headers() -> None:
    options = {
        "queue": Queue("q1", Exchange("ex")),
        "exchange": Exchange("ex"),
        "producer": object(),
        "countdown": 5,
        "eta": NOW,
        "expires": 3,
        "priority": 3,
        "headers": {C.HEADER_STORED: "x", "keep": 1},
        "time_limit": None,
    }
    assert clean_options(options, frozenset({C.HEADER_STORED})) == {
        "queue": "q1",
        "exchange": "ex",
        "priority": 3,
        "headers": {"keep": 1},
    }


def test_encode_decode_round_trip_and_refusals() -> None:
    body = {"args": [1, "a"], "kwargs": {"when": NOW}, "options": {"priority": 1}}
    encoded = encode(body, "json", allow_pickle=False)
    assert encoded.content_type == "application/json"
    assert isinstance(encoded.payload, bytes)
    decoded = decode(encoded.payload, encoded.content_type, encoded.content_encoding, allow_pickle=False)
    assert decoded["args"] == [1, "a"]
    assert decoded["kwargs"]["when"] == NOW
    with pytest.raises(SerializationError, match="cannot encode"):
        encode({"args": [object()], "kwargs": {}, "options": {}}, "json", allow_pickle=False)
    with pytest.raises(SerializationError, match="safe_time_allow_pickle"):
        encode(body, "pickle", allow_pickle=False)
    pickled = encode(body, "pickle", allow_pickle=True)
    with pytest.raises(SerializationError):
        decode(pickled.payload, pickled.content_type, pickled.content_encoding, allow_pickle=False)
    assert decode(pickled.payload, pickled.content_type, pickled.content_encoding, allow_pickle=True) == body
    with pytest.raises(SerializationError, match="corrupt"):
        decode(b"{nope", "application/json", "utf-8", allow_pickle=False)
    with pytest.raises(SerializationError, match="not a stored call"):
        decode(b"[1]", "application/json", "utf-8", allow_pickle=False)


def test_register_adds_sweep_task_and_beat_entry() -> None:
    app = Celery("u", set_as_current=False)
    app.conf.update(
        broker_url="redis://127.0.0.1:6379/0",
        safe_time_sweep_interval=7,
        safe_time_sweep_queue="sweeps",
        beat_schedule={"other": {"task": "x", "schedule": 60}},
    )
    register(app, get_config(app))
    entry = app.conf.beat_schedule[C.SWEEP_ENTRY_NAME]
    assert entry == {"task": C.SWEEP_TASK_NAME, "schedule": 7.0, "options": {"expires": 7.0, "queue": "sweeps"}}
    assert "other" in app.conf.beat_schedule
    assert C.SWEEP_TASK_NAME in app.tasks


def test_task_cls_string_resolves_safetask_lazily() -> None:
    from celery_safe_time.delays.task import SafeTask

    app = Celery("cls", set_as_current=False, task_cls="celery_safe_time:SafeTask")

    @app.task(shared=False)
    def noop() -> None:
        return None

    assert isinstance(app.tasks[noop.name], SafeTask)
