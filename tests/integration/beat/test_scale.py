"""Many runtime entries on Redis and PostgreSQL coordination: a leader that reads only the definitions
of what falls due (and what changes), ``save_entries`` and ``celery safe-time beat import``. Small
sizes (2,000 entries) with the leader's threshold lowered, so the behaviour at scale is what runs."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import delete_entry, entry_audit, get_entry, save_entries, save_entry, signals
from celery_safe_time.beat.backends import BeatBackend, beat_backend
from celery_safe_time.beat.backends.redis import RedisBeatBackend
from celery_safe_time.beat.entries import pause
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError, SerializationError
from tests.helpers.beat import BEAT_APP, beat_env
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

UTC = timezone.utc
TENANTS = 2000
BUSY = [f"busy-{i}" for i in range(5)]


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def app(make_app: Callable[..., Celery], coordination: dict[str, Any]) -> Celery:
    app = make_app(
        **coordination,
        safe_time_beat_lease=3,
        beat_schedule={"cfg": {"task": "t.scale_noop", "schedule": 1.0}},
    )
    app.task(name="t.scale_noop", shared=False)(_noop)
    return app


@pytest.fixture
def sent() -> Iterator[list[tuple[str, float]]]:
    """(entry, slot) of every slot published in this test."""
    out: list[tuple[str, float]] = []

    def on_sent(sender: Any, entry: str, slot: datetime, **kw: Any) -> None:
        out.append((entry, slot.timestamp()))

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    yield out
    signals.beat_slot_dispatched.disconnect(on_sent)


def _tenants(n: int) -> list[dict[str, Any]]:
    """``n`` tenants daily, twelve hours from now (never due in a test), and the busy ones every second."""
    hour = (datetime.now(UTC).hour + 12) % 24
    out: list[dict[str, Any]] = [
        {"name": f"tenant-{i}", "task": "t.scale_noop", "schedule": {
            "type": "crontab", "minute": str(i % 60), "hour": str(hour), "day_of_week": "*",
            "day_of_month": "*", "month_of_year": "*", "tz": ("Europe/Berlin", "Asia/Tokyo", None)[i % 3]},
         "args": [i]}
        for i in range(n)
    ]  # fmt: skip
    out += [{"name": name, "task": "t.scale_noop", "schedule": 1.0} for name in BUSY]
    return out


class Reads:
    """Counts what a leader's backend reads of the runtime definitions (wrapping its own methods)."""

    def __init__(self, backend: BeatBackend) -> None:
        self.names: list[str] = []
        self.full: list[str] = []  # whole reads: snapshot (every definition), scans, entry_definitions
        for method in ("definitions", "read_changed"):
            self._count(backend, method)
        for method in ("snapshot", "scan_definitions", "entry_definitions"):
            self._whole(backend, method)

    def _count(self, backend: BeatBackend, method: str) -> None:
        inner = getattr(backend, method)

        def wrapped(names: list[str]) -> Any:
            self.names.extend(names)
            return inner(names)

        setattr(backend, method, wrapped)

    def _whole(self, backend: BeatBackend, method: str) -> None:
        inner = getattr(backend, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.full.append(method)
            return inner(*args, **kwargs)

        setattr(backend, method, wrapped)


def _leader(app: Celery, tmp_path: Path, label: str) -> SafeScheduler:
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / label), max_interval=1)
    sched.lazy_threshold = 100  # as a leader with 10,000 entries or more
    wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
    return sched


def _fired(sent: list[tuple[str, float]], name: str) -> list[float]:
    return [slot for entry, slot in sent if entry == name]


def _tick_until(sched: SafeScheduler, predicate: Callable[[], Any], timeout: float = 15) -> Any:
    return wait_for(lambda: (sched.tick(), predicate())[1], timeout, interval=0.05)


def _planned(sched: SafeScheduler) -> None:
    """Tick until the leader's plan of every entry (a chunk per tick) is complete."""
    _tick_until(sched, lambda: not sched.replanning, timeout=60)


def _tick_for(sched: SafeScheduler, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sched.tick()
        time.sleep(0.05)


def test_a_leader_with_many_entries_reads_only_the_due_ones_and_applies_changes_from_the_log(
    app: Celery, tmp_path: Path, sent: list[tuple[str, float]]
) -> None:
    assert save_entries(_tenants(TENANTS), app=app) == TENANTS + len(BUSY)
    first = _leader(app, tmp_path, "first")
    try:
        # a fresh leader (no marker): it plans every entry, a chunk at a time, and keeps none
        _tick_until(first, lambda: all(_fired(sent, name) for name in [*BUSY, "cfg"]))
        _planned(first)
        assert first.lazy
        assert len(first.runtime) <= len(BUSY) + 1
        # a pause with an expiry, applied by this leader, expires under the next one
        pause("busy-3", until=timedelta(seconds=3), app=app)
        _tick_for(first, 0.5)
    finally:
        first.close()
    backend = beat_backend(get_config(app))
    assert backend.due_count() >= TENANTS + len(BUSY) - 1

    second = _leader(app, tmp_path, "second")
    reads = Reads(second.backend)
    try:
        paused_at = time.time()
        fired = len(sent)
        time.sleep(1.0)  # a busy entry's slot falls due meanwhile: the takeover's first tick fires it
        second.tick()
        assert not second.replanning  # the previous leader's marker: no plan of every entry
        assert len(sent) > fired
        _tick_until(second, lambda: all(len(_fired(sent, n)) >= 3 for n in ["busy-0", "busy-1", "busy-2", "cfg"]))
        # the takeover read the definitions of the due entries only: none of the 2,000 tenants
        assert reads.full == []
        assert set(reads.names) <= set(BUSY)
        assert second.lazy

        # changes reach it through the change log, without reading everything again
        save_entry("late", "t.scale_noop", 1, app=app)
        save_entry("tenant-7", "t.scale_noop", 1, app=app)  # moved onto a one-second grid
        _tick_until(second, lambda: _fired(sent, "late") and _fired(sent, "tenant-7"))
        pause("busy-0", app=app)
        assert delete_entry("busy-1", app=app)
        # applied: both out of the due set (the leader takes them out as it applies the change)
        _tick_until(second, lambda: backend.read_states(["busy-0", "busy-1"])[1] == [None, None])
        counts = len(_fired(sent, "busy-0")), len(_fired(sent, "busy-1"))
        _tick_for(second, 2.5)
        assert (len(_fired(sent, "busy-0")), len(_fired(sent, "busy-1"))) == counts
        # the pause made under the first leader expired: this one resumed it without having loaded it
        _tick_until(second, lambda: [s for s in _fired(sent, "busy-3") if s > paused_at + 3])
        assert reads.full == []
        assert set(reads.names) <= {*BUSY, "late", "tenant-7"}
    finally:
        second.close()
    for name in {entry for entry, _ in sent}:
        slots = _fired(sent, name)
        assert len(slots) == len(set(slots)), name  # every slot at most once, across the takeover
    info = get_entry("busy-3", app=app)
    assert info is not None
    assert info.enabled


def _lose_state(backend: BeatBackend) -> None:
    """Delete every entry's state and due time by hand, the definitions kept (as a Redis that evicted
    the state, or entries written before saves planned them)."""
    if isinstance(backend, RedisBeatBackend):
        backend.client.delete(backend.keys.state, backend.keys.due)
        return
    import sqlalchemy as sa

    from celery_safe_time.beat.backends.postgres import PostgresBeatBackend

    assert isinstance(backend, PostgresBeatBackend)
    with backend.engine().begin() as conn:
        conn.execute(sa.text("DELETE FROM safe_time_beat_state WHERE ns = :ns"), {"ns": backend.ns})


def test_a_leader_with_no_state_fires_what_is_due_before_its_plan_of_every_entry_ends(
    app: Celery, tmp_path: Path, sent: list[tuple[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(C, "BEAT_LAZY_CHUNK", 50)  # a dozen chunks: a plan that takes many ticks
    late = {"name": "late", "task": "t.scale_noop", "schedule": 1.0, "options": {"safe_time_misfire": "run_all"}}
    assert save_entries([*_tenants(600), late], app=app) == 606
    _lose_state(beat_backend(get_config(app)))
    leader = _leader(app, tmp_path, "fresh")
    step = leader.replan_step
    held = [True]  # the plan's next chunks wait while this holds: as a plan of a million does

    def gated() -> bool:
        return leader.replanning if held[0] else step()

    try:
        leader.tick()  # takes the lease: plans the config entries, the runtime ones wait
        assert leader.replanning
        monkeypatch.setattr(leader, "replan_step", gated)
        _tick_until(leader, lambda: len(_fired(sent, "cfg")) >= 2)
        # the first due slots went out while no runtime entry was planned yet
        assert leader.replanning
        assert not [name for name, _ in sent if name != "cfg"]
        held_at = time.time()
        held[0] = False
        _planned(leader)
        _tick_until(leader, lambda: all(_fired(sent, name) for name in BUSY))
        assert beat_backend(get_config(app)).due_count() == 607  # with cfg
        # planned from the lease's start, not from when its chunk came: the slots that fell due
        # while it waited fire late (run_all: each of them), none lost
        slots = sorted(_fired(sent, "late"))
        assert slots[0] <= min(_fired(sent, "cfg"))
        assert slots[0] < held_at
        assert all(y - x == 1.0 for x, y in itertools.pairwise(slots))
    finally:
        leader.close()
    for name in {entry for entry, _ in sent}:
        slots = _fired(sent, name)
        assert len(slots) == len(set(slots)), name  # every slot at most once


def test_a_fresh_leader_fires_the_due_entries_of_a_bulk_import_before_planning_any(
    app: Celery, tmp_path: Path, sent: list[tuple[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # save_entries plans each new entry's first slot: a leader that never ran finds them due, where
    # it would otherwise plan every entry (34 s at a million) before the busy ones it holds fire
    monkeypatch.setattr(C, "BEAT_LAZY_CHUNK", 50)
    saved_at = time.time()
    assert save_entries(_tenants(600), app=app) == 605
    backend = beat_backend(get_config(app))
    states, scores = backend.read_states(["tenant-1", *BUSY])
    assert all(json.loads(state)["last"] is None for state in states)
    assert all(score is not None and saved_at < score < saved_at + 3 for score in scores[1:])
    leader = _leader(app, tmp_path, "fresh")
    step = leader.replan_step
    held = [True]

    def gated() -> bool:
        return leader.replanning if held[0] else step()

    try:
        leader.tick()
        assert leader.replanning
        monkeypatch.setattr(leader, "replan_step", gated)
        _tick_until(leader, lambda: all(len(_fired(sent, name)) >= 2 for name in BUSY))
        # every busy entry fired twice while no runtime entry was planned by this leader
        assert leader.replanning
        held[0] = False
        _planned(leader)
        _tick_for(leader, 1.5)
        assert backend.due_count() == 606  # with cfg
    finally:
        leader.close()
    for name in BUSY:
        slots = sorted(_fired(sent, name))
        # from the first slot after the save, each second once, none lost across the plan's end
        assert slots[0] - saved_at < 2.5
        assert all(y - x == 1.0 for x, y in itertools.pairwise(slots)), (name, slots)


def test_a_leader_applying_a_bulk_save_in_batches_fires_each_new_entry_at_its_planned_slot(
    app: Celery, tmp_path: Path, sent: list[tuple[str, float]], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # A leader that loads every entry applies the change log a batch per tick; the saves already put
    # the later batches' entries in the due set. It leaves an entry it has not applied yet where it
    # is (dropping it would make its apply a "resume" that skips the planned slot).
    monkeypatch.setattr(C, "BEAT_CHANGES_BATCH", 3)
    caplog.set_level("INFO", logger="celery_safe_time.beat")
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "batches"), max_interval=1)
    wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
    try:
        sched.tick()
        assert not sched.lazy
        names = [f"new-{i}" for i in range(12)]
        save_entries([{"name": n, "task": "t.scale_noop", "schedule": 1.0} for n in names], app=app)
        states, _ = beat_backend(get_config(app)).read_states(names)
        planned = {n: json.loads(state)["next"] for n, state in zip(names, states, strict=True)}
        # every planned slot is due when the leader's next tick reads the due set
        time.sleep(max(0.0, max(planned.values()) - time.time()) + 0.1)
        _tick_until(sched, lambda: all(_fired(sent, n) for n in names))
    finally:
        sched.close()
    for name in names:
        assert min(_fired(sent, name)) == planned[name], name
    assert not [r for r in caplog.records if "resumed" in r.getMessage()]


def test_save_entries_is_idempotent_and_counts_changes(
    make_app: Callable[..., Celery], coordination: dict[str, Any]
) -> None:
    app = make_app(**coordination)
    app.task(name="t.scale_noop", shared=False)(_noop)
    entries = _tenants(30)
    assert save_entries(entries, app=app) == 35
    assert save_entries(entries, app=app) == 0
    entries[0] = {**entries[0], "args": [-1]}
    assert save_entries(iter(entries), app=app) == 1
    info = get_entry("tenant-0", app=app)
    assert info is not None
    assert info.args == (-1,)
    assert len(beat_backend(get_config(app)).entry_definitions()) == 35
    # audited as save_entry audits: the same actions, by the given changer
    save_entries(entries[:1], app=app, changed_by="importer")
    assert [r.action for r in entry_audit("tenant-0", app=app)] == ["update", "create"]
    assert save_entries([{**entries[0], "args": [-2]}], app=app, changed_by="importer") == 1
    assert entry_audit("tenant-0", app=app)[0].changed_by == "importer"


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"schedule": {"type": "weekly"}}, "unknown schedule type 'weekly'"),
        ({"jitter": -1}, "jitter"),
        ({"task": "t.unknown"}, "unknown task 't.unknown'"),
        ({"args": [object()]}, "args must be JSON-serialisable"),
        ({"colour": "red"}, "unknown parameter 'colour'"),
        ({"task": None}, "parameter 'task' is missing"),
    ],
)
def test_save_entries_validates_each_entry_and_stores_nothing_of_a_bad_chunk(
    make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch, bad: dict[str, Any], named: str
) -> None:
    app = make_app()
    app.task(name="t.scale_noop", shared=False)(_noop)
    monkeypatch.setattr(C, "BEAT_SAVE_CHUNK", 3)
    good = [{"name": f"ok-{i}", "task": "t.scale_noop", "schedule": 60} for i in range(4)]
    entries = [*good[:3], good[3], {"name": "bad-one", "task": "t.scale_noop", "schedule": 60, **bad}]
    with pytest.raises((ScheduleError, SerializationError)) as raised:
        save_entries(entries, app=app)
    assert "entry #4 ('bad-one')" in str(raised.value)
    assert named in str(raised.value)
    # the first chunk was stored; the bad entry's chunk (ok-3 with it) was not
    assert set(beat_backend(get_config(app)).entry_definitions()) == {"ok-0", "ok-1", "ok-2"}


def test_beat_import_reads_the_show_json_shape(processes: ProcessManager, tmp_path: Path, redis_url: str) -> None:
    env = beat_env({"cfg": {"task": "tests.record", "every": 3600, "args": ["cfg"]}})
    added = processes.cli(BEAT_APP, "safe-time", "beat", "add", "model", "tests.record", "--every", "30", env=env)
    assert added.returncode == 0, added.stderr
    shown = processes.cli(BEAT_APP, "safe-time", "beat", "show", "model", env=env)
    assert shown.returncode == 0, shown.stderr
    model = json.loads(shown.stdout)
    config = {**model, "name": "cfg", "source": "config"}  # a beat_schedule entry, as show prints it
    lines = [{**model, "name": f"imported-{i}", "args": [i]} for i in range(3)] + [config]
    path = tmp_path / "entries.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    imported = processes.cli(BEAT_APP, "safe-time", "beat", "import", str(path), env=env)
    assert imported.returncode == 0, imported.stderr
    assert "3 entries created or changed, 1 not runtime entries skipped" in imported.stdout
    again = processes.cli(BEAT_APP, "safe-time", "beat", "import", str(path), env=env)
    assert "0 entries created or changed" in again.stdout
    reader = Celery("reader", set_as_current=False)
    reader.conf.update(broker_url=redis_url)
    stored = beat_backend(get_config(reader)).entry_definitions()
    assert set(stored) == {"model", "imported-0", "imported-1", "imported-2"}
    definition = json.loads(stored["imported-2"])
    assert (definition["args"], definition["schedule"]) == ([2], model["schedule"])

    # what beat list --json prints works too: a JSON array (the config entry in it skipped)
    listed = processes.cli(BEAT_APP, "safe-time", "beat", "list", "--json", env=env)
    rows = [{**row, "name": "copy-" + row["name"]} for row in json.loads(listed.stdout)]
    path.write_text(json.dumps(rows, indent=1))
    copied = processes.cli(BEAT_APP, "safe-time", "beat", "import", str(path), env=env)
    assert "4 entries created or changed, 1 not runtime entries skipped" in copied.stdout, copied.stderr
    assert "copy-imported-1" in beat_backend(get_config(reader)).entry_definitions()

    path.write_text(json.dumps({**model, "name": "broken", "schedule": {"type": "weekly"}}) + "\n")
    failed = processes.cli(BEAT_APP, "safe-time", "beat", "import", str(path), env=env)
    assert failed.returncode != 0
    assert "entry #0 ('broken')" in failed.stderr


@pytest.mark.parametrize("coordination", ["redis"], indirect=True)
def test_a_due_set_lost_under_such_a_leader_is_planned_again_in_full(
    app: Celery, tmp_path: Path, sent: list[tuple[str, float]]
) -> None:
    assert save_entries(_tenants(300), app=app) == 305
    leader = _leader(app, tmp_path, "lost")
    try:
        _tick_until(leader, lambda: _fired(sent, "busy-0"))
        _planned(leader)
        backend = beat_backend(get_config(app))
        assert backend.due_count() == 306  # with cfg
        assert leader.lazy
        reads = Reads(leader.backend)
        leader.client.delete(get_config(app).key(C.KEY_BEAT_DUE))  # evicted, or a DEL by hand
        _tick_until(leader, lambda: backend.due_count() == 306)
        assert "scan_definitions" in reads.full  # it could not know which entries it lost: all read
        fired = len(_fired(sent, "busy-0"))
        _tick_until(leader, lambda: len(_fired(sent, "busy-0")) > fired)
    finally:
        leader.close()
