"""run_due keeps a stored delay's trace too (eager, in the test process; no services)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_safe_time import tracing
from celery_safe_time.testing import SafeTimeTesting


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.instrument(tracer_provider=provider)
    yield provider, exporter
    tracing.uninstrument()
    provider.shutdown()


def test_the_callers_trace_continues_in_the_run(
    safe_time: SafeTimeTesting, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced

    @safe_time.app.task(name="t.traced")
    def remind() -> None: ...

    with provider.get_tracer("test").start_as_current_span("signup") as signup:
        remind.apply_async(countdown=14 * 86400)
    assert "traceparent" in safe_time.assert_stored(remind).options["headers"]
    safe_time.run_due(advance=timedelta(days=15))
    [run] = [s for s in exporter.get_finished_spans() if s.name == "run/t.traced"]
    assert run.context.trace_id == signup.get_span_context().trace_id
    assert run.parent is not None
    assert run.parent.span_id == signup.get_span_context().span_id


def test_without_an_active_span_nothing_is_added() -> None:
    assert tracing.inject_context(None) is None
    assert tracing.inject_context({"x": 1}) == {"x": 1}
