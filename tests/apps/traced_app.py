"""App for the cross-process tracing test: real ``celery worker`` and ``celery beat`` processes that
export their spans to files (``SAFE_TIME_TEST_SPANS_DIR``/``spans-<role>-<pid>.jsonl``, one JSON span
per line), instrumented where a deployment would: ``worker_process_init`` in each prefork child,
``beat_init`` in beat."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import beat_init, worker_process_init
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from celery_safe_time import SafeTask, install
from celery_safe_time.delays import tracing
from tests.apps.settings import configure

app = configure(Celery("traced_app"))
app.conf.beat_schedule = {"traced-tick": {"task": "traced_proc.tick", "schedule": 2.0}}
install(app)


@app.task(base=SafeTask, name="traced_proc.remind")
def remind(user_id: int) -> int:
    return user_id


@app.task(name="traced_proc.tick")
def tick() -> str:
    return "ok"


def _json_line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


def _export_spans(role: str) -> None:
    directory = Path(os.environ["SAFE_TIME_TEST_SPANS_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    out = open(directory / f"spans-{role}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - process-long
    provider = TracerProvider(resource=Resource.create({"service.name": f"traced-{role}"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=_json_line)))
    tracing.instrument(tracer_provider=provider)


@worker_process_init.connect
def _worker_child(**_: Any) -> None:
    _export_spans("worker")


@beat_init.connect
def _beat(**_: Any) -> None:
    _export_spans("beat")
