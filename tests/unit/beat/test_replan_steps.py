"""A leader that plans every entry (no previous leader's marker) a chunk per tick, on the in-memory
backend with time injected: it fires what is due before its plan ends, plans every entry from the
lease's start however late its chunk comes (a slot that fell due meanwhile fires late, once), writes
the marker only once the plan is complete, and stops planning when it loses the lease."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from celery_safe_time import constants as C
from celery_safe_time.beat import base as beat_base
from celery_safe_time.beat.backends.base import Snapshot
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import SafeTimeConfig, get_config
from tests.unit.beat.conftest import T0, FakeTime, OnDispatched, memory_app

RUNTIME = [f"r-{i:02d}" for i in range(40)]
CHUNK = 10


def _noop() -> None:
    return None


@pytest.fixture
def sent(on_dispatched: OnDispatched) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []

    def on_sent(sender: Any, entry: str, slot: Any, **kw: Any) -> None:
        out.append((entry, slot.timestamp() - T0))

    on_dispatched(on_sent)
    return out


class Stored:
    """The runtime definitions and the applied marker the in-memory backend does not keep."""

    def __init__(self) -> None:
        self.definitions = {
            name: json.dumps(
                {
                    "args": [],
                    "enabled": True,
                    "format": 1,
                    "kwargs": {},
                    "name": name,
                    "options": {},
                    "schedule": {"every": 1.0, "type": "interval"},
                    "task": "t.replan_noop",
                },
                separators=(",", ":"),
                sort_keys=True,
            )
            for name in RUNTIME
        }
        self.marker: str | None = None


class DefinitionsBackend(MemoryBeatBackend):
    """The in-memory backend with runtime definitions (fixed: the test saves none) and a marker, read
    as Redis serves a leader that reads only what is due (chunks in name order: the base's scan)."""

    reads_due_only = True

    def __init__(self, config: SafeTimeConfig, data: MemoryBeatData, stored: Stored) -> None:
        super().__init__(config, data)
        self.stored = stored

    def snapshot(self) -> Snapshot:
        return Snapshot(version=len(RUNTIME), definitions=dict(self.stored.definitions), requests={},
                        marker=self.stored.marker)  # fmt: skip

    def entry_definition(self, name: str) -> Any:
        return self.stored.definitions.get(name)

    def entry_definitions(self, prefix: str | None = None) -> dict[str, Any]:
        return dict(self.stored.definitions)

    def mark_applied(self, token: str, marker: str) -> None:
        if self.data.held_by(token):
            self.stored.marker = marker


@pytest.fixture
def app(data: MemoryBeatData, monkeypatch: pytest.MonkeyPatch) -> Any:
    stored = Stored()
    monkeypatch.setattr(beat_base, "beat_backend", lambda config: DefinitionsBackend(config, data, stored))
    monkeypatch.setattr(C, "BEAT_LAZY_CHUNK", CHUNK)
    app = memory_app("replan-steps", beat_schedule={"cfg": {"task": "t.replan_noop", "schedule": 1.0}})
    app.task(name="t.replan_noop", shared=False)(_noop)
    get_config(app)
    return app


def _leader(app: Any, tmp_path: Path, name: str) -> SafeScheduler:
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / name), max_interval=1)
    sched.keeper._stop.set()  # drive the lease by hand (``_attempt``), on the injected clock
    sched.lazy_threshold = CHUNK  # reads only what is due, as with 10,000 entries
    return sched


def _take_over(sched: SafeScheduler) -> None:
    sched.keeper._stop.clear()
    assert sched.keeper._attempt()
    sched.keeper._stop.set()


def _slots(sent: list[tuple[str, float]], name: str) -> list[float]:
    return [slot for entry, slot in sent if entry == name]


def test_a_fresh_leader_fires_before_its_plan_ends_and_plans_late_chunks_from_the_lease_start(
    app: Any, tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float]]
) -> None:
    clock.now = T0 + 0.5
    a = _leader(app, tmp_path, "a")
    try:
        assert a.keeper.is_leader
        a.tick()  # takes the lease: the config entries are planned, the runtime ones wait
        assert a.replanning
        assert a.backend.snapshot_meta().marker in (None, "")
        steps = 0
        while a.replanning:
            clock.now += 1.0
            a.tick()  # one chunk of runtime entries, then what is due
            steps += 1
            if steps == 1:
                # the first due slot went out while most entries were still unplanned
                assert _slots(sent, "cfg") == [1.0]
                assert a.replanning
                assert a.backend.due_count() <= len(a.config_names) + CHUNK
        assert steps >= len(RUNTIME) // CHUNK
        # every entry planned from the lease's start (T0 + 0.5): the last chunk, planned seconds
        # later, still fires its first slot T0 + 1, late, and each slot once
        for name in ["cfg", *RUNTIME]:
            slots = _slots(sent, name)
            assert slots[0] == 1.0, name
            assert all(y - x == 1.0 for x, y in itertools.pairwise(slots)), name
        assert a.backend.due_count() == len(a.config_names) + len(RUNTIME)
        # complete: the marker says so, and a takeover trusts it (plans only what changed)
        assert (a.backend.snapshot_meta().marker or "").startswith(f"{len(RUNTIME)} ")
    finally:
        a.close()
    clock.now += 1.0
    b = _leader(app, tmp_path, "b")
    try:
        _take_over(b)
        b.tick()
        assert not b.replanning
        last = {name: _slots(sent, name)[-1] for name in RUNTIME}
        clock.now += 1.0
        b.tick()
        for name in RUNTIME:  # the grid goes on where the first leader left it, nothing twice
            slots = _slots(sent, name)
            assert len(slots) == len(set(slots)), name
            assert slots[-1] > last[name], name
    finally:
        b.close()


def test_a_leader_that_loses_the_lease_half_way_stops_planning_and_the_next_plans_everything(
    app: Any, tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float]]
) -> None:
    clock.now = T0 + 0.5
    a = _leader(app, tmp_path, "a")
    b = _leader(app, tmp_path, "b")
    try:
        a.tick()
        clock.now += 1.0
        a.tick()
        assert a.replanning
        planned = a.backend.due_count()
        # a stalls past its lease; b takes over, with no marker: it plans every entry itself
        clock.now += 31.0
        _take_over(b)
        a.tick()  # its next chunk's write is refused: it stops, writing nothing more
        assert not a.keeper.is_leader
        assert not a.replanning
        assert a.backend.due_count() == planned
        b.tick()
        assert b.replanning
        while b.replanning:
            clock.now += 1.0
            b.tick()
        assert b.backend.due_count() == len(b.config_names) + len(RUNTIME)
        assert (b.backend.snapshot_meta().marker or "").startswith(f"{len(RUNTIME)} ")
    finally:
        a.close()
        b.close()
    for name in {entry for entry, _ in sent}:
        slots = _slots(sent, name)
        assert len(slots) == len(set(slots)), name


def test_a_backend_error_half_way_ends_the_term_and_the_next_term_plans_everything(
    app: Any, tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float]]
) -> None:
    clock.now = T0 + 0.5
    a = _leader(app, tmp_path, "a")
    try:
        a.tick()
        clock.now += 1.0
        a.tick()
        data.down = True  # an outage in the middle of the plan: the leader stands by
        a.tick()
        data.down = False
        assert not a.keeper.is_leader
        assert not a.replanning
        clock.now += 1.0
        _take_over(a)
        a.tick()
        assert a.replanning  # no marker was written: the new term plans every entry
        while a.replanning:
            clock.now += 1.0
            a.tick()
        assert a.backend.due_count() == len(a.config_names) + len(RUNTIME)
        for name in RUNTIME:
            slots = _slots(sent, name)
            assert slots, name
            assert len(slots) == len(set(slots)), name
    finally:
        a.close()
