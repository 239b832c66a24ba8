"""OpenTelemetry: a trace started at ``apply_async(countdown=14 days)`` continues in the worker's span
when the stored delay runs, and beat-published tasks carry slot and epoch. Real Redis broker, SQLite
store, a real worker (in-process, so the SDK's in-memory exporter sees every span) and the real sweep."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_safe_time import SafeTask, reschedule
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

DAY = 86400


def _wait(predicate: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_a_14_day_delay_continues_the_callers_trace_in_the_worker(
    make_app: Callable[..., Celery], spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    app = make_app("traced", safe_time_delay_threshold=60)

    @app.task(base=SafeTask, name="traced.remind")
    def remind(user_id: int) -> int:
        return user_id

    with provider.get_tracer("test").start_as_current_span("signup") as signup:
        result = remind.apply_async((42,), countdown=14 * DAY)
    row = get_store(app).get(result.id)
    assert row is not None
    assert row.status == "pending"
    # Nothing was published at the call: the context lives in the stored row's headers only.
    assert _named(exporter, "apply_async/traced.remind") == []

    assert reschedule(result.id, countdown=0, app=app)  # "14 days later"
    with start_worker(app, perform_ping_check=False, pool="solo", shutdown_timeout=10):
        # Outside any span, as beat's sweep task would run. (The worker may start the row before the
        # sweep marks it sent, so "sent" can be 0: the claim and the publish are what count here.)
        stats = sweep(app)
        assert (stats.claimed, stats.failed) == (1, 0)
        _wait(lambda: _named(exporter, "run/traced.remind"))
    [run] = _named(exporter, "run/traced.remind")
    [publish] = _named(exporter, "apply_async/traced.remind")
    trace_id = signup.get_span_context().trace_id
    assert run.context.trace_id == trace_id
    assert publish.context.trace_id == trace_id
    assert publish.parent is not None
    assert publish.parent.span_id == signup.get_span_context().span_id
    assert run.parent is not None
    assert run.parent.span_id == publish.context.span_id
    assert run.attributes is not None
    assert run.attributes["safe_time.stored_due_at"]
    assert _wait(lambda: get_store(app).get(result.id).outcome) == "succeeded"  # type: ignore[union-attr]


def test_beat_published_tasks_carry_slot_and_epoch(
    make_app: Callable[..., Celery], tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    _provider, exporter = spans
    app = make_app(
        "traced-beat", safe_time_beat_lease=3, beat_schedule={"tick-entry": {"task": "traced.tick", "schedule": 2.0}}
    )

    @app.task(name="traced.tick")
    def tick() -> str:
        return "ok"

    # A real SafeScheduler, ticked in this process so the in-memory exporter sees the beat's span too.
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        with start_worker(app, perform_ping_check=False, pool="solo", shutdown_timeout=10):
            _wait(lambda: (sched.tick(), _named(exporter, "run/traced.tick"))[1])
    finally:
        sched.close()
    run = _named(exporter, "run/traced.tick")[0]
    publish = next(s for s in _named(exporter, "apply_async/traced.tick") if s.context.trace_id == run.context.trace_id)
    for span in (run, publish):
        assert span.attributes is not None
        assert span.attributes["safe_time.epoch"] == 1
        slot = datetime.fromisoformat(str(span.attributes["safe_time.slot"]))
        assert abs((datetime.now(timezone.utc) - slot).total_seconds()) < 60
