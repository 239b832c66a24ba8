"""run_due keeps a stored delay's trace too (eager, in the test process; no services)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_safe_time.delays import tracing
from celery_safe_time.testing import SafeTimeTesting


def test_the_callers_trace_continues_in_the_run(
    safe_time: SafeTimeTesting, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans

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


def test_a_stored_retry_continues_from_the_run_that_asked_for_it(
    safe_time: SafeTimeTesting, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    attempts: list[int] = []

    @safe_time.app.task(name="t.retried", bind=True, max_retries=1)
    def retried(self: Any) -> None:
        attempts.append(self.request.retries)
        if not attempts[1:]:
            raise self.retry(countdown=3600)

    with provider.get_tracer("test").start_as_current_span("signup"):
        retried.apply_async(countdown=86400)
    safe_time.run_due(advance=timedelta(days=2))
    assert attempts == [0, 1]
    first, second = sorted(
        (s for s in exporter.get_finished_spans() if s.name == "run/t.retried"), key=lambda s: s.start_time or 0
    )
    assert second.context.trace_id == first.context.trace_id
    assert second.parent is not None
    assert second.parent.span_id == first.context.span_id  # not the signup span the copied headers named


def test_without_an_active_span_nothing_is_added() -> None:
    assert tracing.inject_context(None) is None
    assert tracing.inject_context({"x": 1}) == {"x": 1}
