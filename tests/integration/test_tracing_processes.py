"""OpenTelemetry across processes: the trace started at ``apply_async(countdown=14 days)`` in this
process continues in the span of a real ``celery worker`` (prefork child) when the stored delay runs
after a real sweep (beat publishes the sweep entry, a worker child sweeps), and a real ``celery beat``
publishes its entries with slot and epoch on the producer and worker spans. Worker and beat export
their spans to files (``tests/apps/traced_app.py``); this process keeps its own in memory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_safe_time import SafeTask, install, reschedule
from celery_safe_time.delays.backends import get_store
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

DAY = 86400
APP = "tests.apps.traced_app"


def exported(directory: Path) -> list[dict[str, Any]]:
    """Every span the worker and beat processes wrote, with the file (role and pid) it came from."""
    found = []
    for path in sorted(directory.glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                found.append({**json.loads(line), "file": path.name})
    return found


def named(found: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in found if s["name"] == name]


def test_a_14_day_delay_continues_the_callers_trace_in_a_worker_process_after_a_real_sweep(
    make_app: Callable[..., Celery],
    processes: ProcessManager,
    tmp_path: Path,
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _exporter = spans
    conf = {"safe_time_sweep_interval": 1, "safe_time_beat_lease": 3}
    app = make_app("traced-client", **conf)
    install(app)

    @app.task(base=SafeTask, name="traced_proc.remind")
    def remind(user_id: int) -> int:
        return user_id

    with provider.get_tracer("test").start_as_current_span("signup") as signup:
        result = remind.apply_async((42,), countdown=14 * DAY)
    row = get_store(app).get(result.id)
    assert row is not None
    assert row.status == "pending"
    assert reschedule(result.id, countdown=0, app=app)  # "14 days later"

    span_dir = tmp_path / "spans"
    env = {"SAFE_TIME_TEST_SPANS_DIR": str(span_dir), "SAFE_TIME_TEST_APP_CONF": json.dumps(conf)}
    worker = processes.worker(APP, name="traced-worker", env=env, concurrency=2)
    beat = processes.beat(APP, name="traced-beat", env=env)
    wait_for(
        lambda: (
            named(exported(span_dir), "run/traced_proc.remind") and named(exported(span_dir), "run/traced_proc.tick")
        ),
        90,
        message="the stored delay and a beat entry to run on the worker",
    )
    found = exported(span_dir)

    # The stored delay: caller (this process) -> sweep's publish (a worker child) -> run (a worker child).
    [run] = named(found, "run/traced_proc.remind")
    [publish] = named(found, "apply_async/traced_proc.remind")
    trace_id = f"0x{signup.get_span_context().trace_id:032x}"
    assert run["context"]["trace_id"] == trace_id
    assert publish["context"]["trace_id"] == trace_id
    assert publish["parent_id"] == f"0x{signup.get_span_context().span_id:016x}"
    assert run["parent_id"] == publish["context"]["span_id"]
    assert run["attributes"]["safe_time.stored_due_at"]
    assert run["file"].startswith("spans-worker-")
    assert run["file"] != f"spans-worker-{os.getpid()}.jsonl"
    # The publish happened inside the sweep task, run by beat's sweep entry on the worker.
    sweeps = [s for s in named(found, "run/celery_safe_time.sweep") if s["file"] == publish["file"]]
    assert sweeps, sorted({s["name"] for s in found})
    wait_for(lambda: get_store(app).get(result.id).outcome == "succeeded", 30, message="the row's outcome")  # type: ignore[union-attr]

    # Beat's own entry: the producer span in the beat process and the run in a worker child, one
    # trace, both with the slot and the lease epoch.
    tick_run = named(found, "run/traced_proc.tick")[0]
    tick_publish = next(
        s
        for s in named(found, "apply_async/traced_proc.tick")
        if s["context"]["trace_id"] == tick_run["context"]["trace_id"]
    )
    assert tick_publish["file"].startswith("spans-beat-")
    assert tick_run["parent_id"] == tick_publish["context"]["span_id"]
    for span in (tick_publish, tick_run):
        assert span["attributes"]["safe_time.epoch"] >= 1
        slot = datetime.fromisoformat(str(span["attributes"]["safe_time.slot"]))
        assert abs((datetime.now(timezone.utc) - slot).total_seconds()) < 120
    assert worker.alive()
    assert beat.alive()
