"""OpenTelemetry across stored delays (``pip install celery-safe-time[otel]``).

A stored delay is published by the sweep, not by ``apply_async``, so the instrumentation's header
propagation would lose the caller's context. ``SafeTask.apply_async`` injects it into the stored
headers (:func:`inject_context`), and the sweep publishes each row under it
(:func:`in_stored_context`): caller, producer and worker spans form one trace. :func:`instrument`
starts the Celery instrumentation and adds the package's span attributes (``safe_time.slot``,
``safe_time.epoch``, ``safe_time.stored_due_at``). Without opentelemetry every function is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from celery import signals as celery_signals

from .. import constants as C

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: Span attribute name per message header.
ATTRIBUTES: dict[str, str] = {
    C.HEADER_SLOT: "safe_time.slot",
    C.HEADER_EPOCH: "safe_time.epoch",
    C.HEADER_STORED: "safe_time.stored_due_at",
}

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace
except ImportError:  # pragma: no cover - depends on the extra
    otel_context = None  # type: ignore[assignment]
    otel_propagate = None  # type: ignore[assignment]
    otel_trace = None  # type: ignore[assignment]


def inject_context(headers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``headers`` plus the current trace context (as the global propagator writes it), for storing.

    Returns ``headers`` unchanged (None stays None) when there is no active context or no opentelemetry.
    """
    carrier: dict[str, Any] = {}
    if otel_propagate is not None:
        otel_propagate.inject(carrier)
    if not carrier:
        return dict(headers) if headers is not None else None
    # The current context wins over a copied one (retry() copies the running request's headers).
    return {**dict(headers or {}), **carrier}


def in_stored_context(headers: Mapping[str, Any], call: Callable[..., R]) -> Callable[..., R]:
    """``call`` wrapped to run under the trace context stored in ``headers`` (the sweep's publish).

    ``call`` itself when ``headers`` hold no valid context (most rows): the sweep calls this once per
    row, and a wrapper with a context manager around every publish costs a few percent of its time.
    """
    if otel_propagate is None or otel_context is None or otel_trace is None:
        return call
    extracted = otel_propagate.extract(dict(headers))
    if not otel_trace.get_current_span(extracted).get_span_context().is_valid:
        return call
    attach, detach = otel_context.attach, otel_context.detach

    def wrapped(*args: Any, **kwargs: Any) -> R:
        token = attach(extracted)
        try:
            return call(*args, **kwargs)
        finally:
            detach(token)

    return wrapped


def _set_attributes(headers: Mapping[str, Any] | None) -> None:
    if otel_trace is None or not headers:
        return
    span = otel_trace.get_current_span()
    if not span.is_recording():
        return
    for header, attribute in ATTRIBUTES.items():
        value = headers.get(header)
        if value is not None:
            span.set_attribute(attribute, value if isinstance(value, (int, float)) else str(value))


def _on_prerun(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    request = getattr(task, "request", None)
    _set_attributes(getattr(request, "headers", None) or {})


def _on_publish(sender: Any = None, headers: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
    _set_attributes(headers)


_connected = False


def instrument(tracer_provider: Any = None, **kwargs: Any) -> None:
    """Instrument Celery (opentelemetry-instrumentation-celery) and add the safe-time span attributes.

    Call it where you would call ``CeleryInstrumentor().instrument()`` (``worker_process_init`` in
    prefork workers, beat's start): the attribute receivers are connected after the instrumentation's,
    so the current span in them is the instrumentation's. Safe to call more than once.
    """
    global _connected
    try:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
    except ImportError as exc:
        from ..exceptions import NotInstalled

        raise NotInstalled("tracing needs pip install 'celery-safe-time[otel]'") from exc
    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=tracer_provider, **kwargs)
    if not _connected:
        celery_signals.task_prerun.connect(_on_prerun, weak=False)
        celery_signals.before_task_publish.connect(_on_publish, weak=False)
        _connected = True


def uninstrument() -> None:
    """Undo :func:`instrument` (tests)."""
    global _connected
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().uninstrument()  # type: ignore[no-untyped-call]
    celery_signals.task_prerun.disconnect(_on_prerun)
    celery_signals.before_task_publish.disconnect(_on_publish)
    _connected = False
