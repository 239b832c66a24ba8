"""Run history and change audit on the in-memory beat backend, time injected: the records a leader
writes with its dispatches, the outcome a worker reports, trimming, the audit records and their parsing."""

from __future__ import annotations

import importlib
import json
import logging
import types
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time.beat import history
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.beat.state import with_definitions
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ImproperlyConfigured
from tests.unit.beat.conftest import T0, FakeTime, OnDispatched, memory_app


@pytest.fixture
def sent(on_dispatched: OnDispatched) -> list[tuple[str, float, Any]]:
    out: list[tuple[str, float, Any]] = []

    def on_sent(sender: Any, entry: str, slot: Any, epoch: int, task_id: Any = None, **kw: Any) -> None:
        out.append((entry, slot.timestamp(), task_id))

    on_dispatched(on_sent)
    return out


def _noop() -> None:
    return None


def _app(**conf: Any) -> Celery:
    app = memory_app("memory-history", beat_schedule={"e": {"task": "t.history_noop", "schedule": 1.0}}, **conf)
    app.task(name="t.history_noop", shared=False)(_noop)
    get_config(app)
    return app


def _tick(tmp_path: Path, app: Celery, clock: FakeTime, ticks: int) -> None:
    """A scheduler of ``app`` ticking ``ticks`` times a second apart, then closed."""
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    sched.keeper._stop.set()
    try:
        for _ in range(ticks):
            clock.now += 1.0
            sched.tick()
    finally:
        sched.close()


def test_each_published_slot_has_a_record_naming_its_task_id_and_the_worker_fills_in_the_outcome(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, Any]]
) -> None:
    app = _app(safe_time_beat_history_size=3)
    _tick(tmp_path, app, clock, 6)
    runs = history.entry_history("e", app=app)
    assert len(runs) == 3  # trimmed to the size, newest slot first
    assert [r.slot.timestamp() for r in runs] == sorted((s for _, s, _ in sent), reverse=True)[:3]
    by_slot = {slot: task_id for _, slot, task_id in sent}
    for run in runs:
        assert run.task_id == by_slot[run.slot.timestamp()]  # the id the publish used
        assert run.outcome == C.RUN_PUBLISHED
        assert run.epoch == 1
        assert run.via == "beat"
        assert run.lateness is not None
        assert 0.0 <= run.lateness < 1.0
    newest = runs[0]
    request = types.SimpleNamespace(
        headers={C.HEADER_ENTRY: "e", C.HEADER_SLOT: newest.slot.isoformat()}, hostname="w1@h", retries=0
    )
    history.on_prerun(task_id=newest.task_id, task=types.SimpleNamespace(request=request))
    history.report_outcome(app, request, "FAILURE", newest.task_id)
    after = history.entry_history("e", app=app, limit=1)[0]
    assert (after.outcome, after.worker, after.retries) == (C.RUN_FAILED, "w1@h", 0)
    assert after.runtime is not None
    assert after.runtime >= 0
    assert after.finished_at is not None
    # a run that is not kept (trimmed away) is not brought back by its outcome
    old = types.SimpleNamespace(headers={C.HEADER_ENTRY: "e", C.HEADER_SLOT: "2000-01-01T00:00:00+00:00"})
    history.report_outcome(app, old, "SUCCESS", "x")
    assert len(history.entry_history("e", app=app)) == 3


def test_a_copy_a_gate_dropped_is_recorded_as_dropped_not_succeeded(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData
) -> None:
    app = _app(safe_time_beat_history_size=3)
    _tick(tmp_path, app, clock, 3)
    run = history.entry_history("e", app=app, limit=1)[0]
    headers = {C.HEADER_ENTRY: "e", C.HEADER_SLOT: run.slot.isoformat()}
    dropped = types.SimpleNamespace(headers=headers, hostname="w1@h", retries=0)
    setattr(dropped, C.REQUEST_ADMISSION_ATTR, C.ADMISSION_DUPLICATE)
    history.report_outcome(app, dropped, "IGNORED", run.task_id)
    assert history.entry_history("e", app=app, limit=1)[0].outcome == C.RUN_DROPPED
    # a run the worker skipped by a gate's rule (overlap skip, an idempotent key already recorded)
    skipped = types.SimpleNamespace(headers=headers, hostname="w1@h", retries=0)
    setattr(skipped, C.REQUEST_ADMISSION_ATTR, C.ADMISSION_SKIPPED)
    history.report_outcome(app, skipped, "SUCCESS", run.task_id)
    assert history.entry_history("e", app=app, limit=1)[0].outcome == C.RUN_DROPPED
    # a body that raises Ignore itself ran: succeeded, as before
    history.report_outcome(app, types.SimpleNamespace(headers=headers), "IGNORED", run.task_id)
    assert history.entry_history("e", app=app, limit=1)[0].outcome == C.RUN_SUCCEEDED


def test_the_worker_side_never_raises(data: MemoryBeatData, caplog: pytest.LogCaptureFixture) -> None:
    app = _app()
    data.down = True
    request = types.SimpleNamespace(headers={C.HEADER_ENTRY: "e", C.HEADER_SLOT: "2026-01-01T00:00:00+00:00"})
    # at_level: a test before this one in the same process may have left the root logger at ERROR
    with caplog.at_level(logging.WARNING, logger=history.__name__):
        history.report_outcome(app, request, "SUCCESS", "t1")  # the backend is down: logged, swallowed
    assert "could not be written" in caplog.text
    bad = types.SimpleNamespace(headers={C.HEADER_ENTRY: "e", C.HEADER_SLOT: "not a time"})
    history.report_outcome(app, bad, "SUCCESS", "t2")
    history.report_outcome(app, types.SimpleNamespace(headers=None), "SUCCESS", "t3")  # not from beat: nothing


def test_history_size_zero_writes_no_record_and_publishes_as_before(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, Any]]
) -> None:
    app = _app(safe_time_beat_history_size=0)
    _tick(tmp_path, app, clock, 3)
    assert sent
    assert data.history == {}
    assert history.entry_history("e", app=app) == []


def test_audit_records_are_capped_and_read_newest_first(data: MemoryBeatData) -> None:
    app = _app(safe_time_beat_audit_size=2)
    backend = MemoryBeatBackend(get_config(app), data)
    old = json.dumps({"task": "a", "enabled": True})
    new = json.dumps({"task": "a", "enabled": False})
    meta = history.audit_meta(backend.config, "save", "ann@h1", T0)
    assert meta is not None
    backend.audit_append("x", with_definitions(meta, None, old, 1))
    backend.audit_append(
        "x", with_definitions(history.audit_meta(backend.config, "pause", "bob@h2", T0 + 1) or "", old, new, 2)
    )
    history.record_audit(backend, "x", "run-now", None, T0 + 2, slot="s")
    records = history.entry_audit("x", app=app)
    assert [(r.action, r.version) for r in records] == [("run-now", None), ("pause", 2)]
    assert records[0].changed_by == history.default_changed_by()
    assert records[0].detail == {"slot": "s"}
    assert (records[1].changed_by, records[1].old, records[1].new) == (
        "bob@h2",
        {"task": "a", "enabled": True},
        {"task": "a", "enabled": False},
    )
    first = history.audit_record("x", with_definitions(meta, None, old, 1))
    assert first is not None
    assert first.action == "create"
    assert history.audit_meta(get_config(_app(safe_time_beat_audit_size=0)), "save", None, T0) is None


@pytest.mark.parametrize("setting", ["safe_time_beat_history_size", "safe_time_beat_audit_size"])
@pytest.mark.parametrize("value", [-1, 1.5, "50", True])
def test_sizes_must_be_whole_numbers(setting: str, value: Any) -> None:
    app = Celery("bad-size", set_as_current=False)
    app.conf.update(safe_time_redis_url="redis://127.0.0.1:1/0", **{setting: value})
    with pytest.raises(ImproperlyConfigured, match=setting):
        get_config(app)


def test_the_worker_hooks_report_beat_tasks_only(data: MemoryBeatData) -> None:
    install = importlib.import_module("celery_safe_time.install")  # the package attribute is the function

    app = _app()
    backend = MemoryBeatBackend(get_config(app), data)
    backend.history_record("e", T0, history.published_record(T0, T0 + 0.5, "tid", 1, "h"))
    backend.history_record("f", T0, history.published_record(T0, T0 + 0.5, "tid2", 1, "h"))
    headers = {C.HEADER_ENTRY: "e", C.HEADER_SLOT: "2027-01-15T08:00:00+00:00"}
    request = types.SimpleNamespace(hostname="w@h", retries=2, **headers)  # as Celery sets protocol 2 headers
    task = types.SimpleNamespace(request=request, _get_app=lambda: app)
    install._run_started(task=task, task_id="tid")
    install._run_finished(task=task, task_id="tid", state="RETRY")
    run = history.entry_history("e", app=app)[0]
    assert (run.outcome, run.retries, run.worker) == (C.RUN_RETRIED, 2, "w@h")
    assert run.runtime is not None
    revoked = types.SimpleNamespace(id="tid2", headers={C.HEADER_ENTRY: "f", C.HEADER_SLOT: "2027-01-15T08:00:00Z"})
    install._run_revoked(sender=task, request=revoked, expired=False)
    assert history.entry_history("f", app=app)[0].outcome == C.RUN_REVOKED
    plain = types.SimpleNamespace(request=types.SimpleNamespace(headers={}), _get_app=lambda: app)
    install._run_finished(task=plain, task_id="other", state="SUCCESS")  # not from beat: nothing, no error
    assert not install._from_beat(None)


def test_a_slot_whose_publish_failed_shows_not_published(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.beat import Scheduler

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("broker down")

    app = _app()
    monkeypatch.setattr(Scheduler, "apply_async", refuse)
    _tick(tmp_path, app, clock, 2)
    runs = history.entry_history("e", app=app)
    assert runs
    assert {r.outcome for r in runs} == {C.RUN_NOT_PUBLISHED}
