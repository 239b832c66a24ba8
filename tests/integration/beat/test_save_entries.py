"""``save_entries`` on Redis and PostgreSQL coordination: the bytes, versions, audit records and
counts of a bulk save are those of one ``save_entry`` after the other, the unchanged entries of a
re-import write nothing, and a bad entry stores nothing of its chunk."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import entry_audit, get_entry, save_entries, save_entry
from celery_safe_time.beat.backends import beat_backend
from celery_safe_time.beat.shards import shard_of
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError
from tests.helpers.beat import coordination_settings

pytestmark = pytest.mark.integration

BERLIN_NINE = {
    "type": "crontab", "minute": "0", "hour": "9", "day_of_week": "*", "day_of_month": "*",
    "month_of_year": "*", "tz": "Europe/Berlin",
}  # fmt: skip


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def app(make_app: Callable[..., Celery], coordination: dict[str, Any]) -> Celery:
    app = make_app(**coordination, safe_time_beat_audit_size=3)
    app.task(name="t.save_noop", shared=False)(_noop)
    app.task(name="t.other_noop", shared=False)(_noop)
    return app


def _mixed() -> list[dict[str, Any]]:
    """Items of every shape a bulk save meets: specs in another key order, numbers that encode apart
    (60 and 60.0), schedule objects, policies, kwargs, options, non-ASCII names, paused entries."""
    reordered = dict(reversed(list(BERLIN_NINE.items())))
    return [
        {"name": "tenant-a", "task": "t.save_noop", "schedule": BERLIN_NINE, "args": [1, "x", None, True]},
        {"name": "tenant-b", "task": "t.save_noop", "schedule": reordered, "args": [2.5]},
        {"name": "ténant-ü", "task": "t.other_noop", "schedule": {"type": "interval", "every": 60}},
        {"name": "every-float", "task": "t.save_noop", "schedule": {"type": "interval", "every": 60.0}},
        {"name": "number", "task": "t.save_noop", "schedule": 30, "kwargs": {"b": 1, "a": {"z": [1, 2]}}},
        {"name": "delta", "task": "t.save_noop", "schedule": timedelta(minutes=5), "enabled": False},
        {"name": "jittered", "task": "t.save_noop", "schedule": BERLIN_NINE, "jitter": 30,
         "options": {"queue": "reports", "priority": 3}},
        {"name": "overlap", "task": "t.save_noop", "schedule": BERLIN_NINE, "overlap": "skip",
         "catchup_window": timedelta(minutes=2), "overlap_ttl": None},
        {"name": "nested-args", "task": "t.save_noop", "schedule": BERLIN_NINE, "args": [(1, 2), {"k": "v"}]},
        {"name": "empty-options", "task": "t.save_noop", "schedule": BERLIN_NINE, "options": {}, "kwargs": {}},
    ]  # fmt: skip


def test_save_entries_stores_what_save_entry_stores(app: Celery, make_app: Callable[..., Celery]) -> None:
    backend = beat_backend(get_config(app))
    items = _mixed()
    assert save_entries(items, app=app) == len(items)
    bulk = {name: _text(raw) for name, raw in backend.entry_definitions().items()}
    for item in items:
        params = {k: v for k, v in item.items() if k not in ("name", "task", "schedule")}
        save_entry(f"single-{item['name']}", item["task"], item["schedule"], app=app, **params)
    single = {name: _text(raw) for name, raw in backend.entry_definitions("single-").items()}
    for item in items:
        name = item["name"]
        expected = json.loads(single[f"single-{name}"])
        expected["name"] = name
        # the same bytes as save_entry's definition_json (with the entry's own name)
        assert bulk[name] == json.dumps(expected, sort_keys=True, separators=(",", ":")), name
    assert json.loads(bulk["every-float"])["schedule"]["every"] == 60.0
    assert isinstance(json.loads(bulk["ténant-ü"])["schedule"]["every"], int)


def test_a_reimport_writes_nothing_and_changes_are_versioned_and_audited(app: Celery) -> None:
    backend = beat_backend(get_config(app))
    items = [{"name": f"tenant-{i}", "task": "t.save_noop", "schedule": BERLIN_NINE, "args": [i]} for i in range(40)]
    assert save_entries(items, app=app, changed_by="importer") == 40
    version = backend.snapshot_meta().version
    assert backend.change_count() == backend.definition_count() == 40
    assert save_entries(items, app=app, changed_by="importer") == 0  # unchanged: nothing written
    assert backend.snapshot_meta().version == version
    assert [r.action for r in entry_audit("tenant-7", app=app)] == ["create"]

    changed = [{**item, "args": [-1]} if i % 10 == 3 else item for i, item in enumerate(items)]
    assert save_entries(changed, app=app, changed_by="second") == 4
    log = dict((_text(name), int(v)) for name, v in backend.change_log(since=version))
    assert log == {f"tenant-{i}": version + n + 1 for n, i in enumerate((3, 13, 23, 33))}
    assert backend.snapshot_meta().version == version + 4
    newest = entry_audit("tenant-13", app=app)[0]
    assert (newest.action, newest.changed_by, newest.version) == ("update", "second", version + 2)
    assert newest.old is not None
    assert newest.new is not None
    assert (newest.old["args"], newest.new["args"]) == ([13], [-1])
    assert entry_audit("tenant-14", app=app)[0].changed_by == "importer"
    assert backend.definition_count() == 40

    # each entry keeps its last 3 changes (safe_time_beat_audit_size)
    for n in range(4):
        save_entries([{**items[3], "args": [100 + n]}], app=app)
    audit = entry_audit("tenant-3", app=app, limit=10)
    assert [r.new["args"] for r in audit if r.new] == [[103], [102], [101]]


def test_a_bulk_save_without_the_audit_keeps_none(
    make_app: Callable[..., Celery], coordination: dict[str, Any]
) -> None:
    app = make_app(**coordination, safe_time_beat_audit_size=0)
    app.task(name="t.save_noop", shared=False)(_noop)
    assert save_entries([{"name": "quiet", "task": "t.save_noop", "schedule": 60}], app=app) == 1
    assert entry_audit("quiet", app=app) == []
    assert beat_backend(get_config(app)).definition_count() == 1


def test_a_bad_entry_stores_nothing_of_its_chunk_and_is_named(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "BEAT_SAVE_CHUNK", 4)
    good = [{"name": f"ok-{i}", "task": "t.save_noop", "schedule": BERLIN_NINE} for i in range(6)]
    bad = {"name": "bad-tz", "task": "t.save_noop", "schedule": {**BERLIN_NINE, "tz": "Mars/Olympus"}}
    with pytest.raises(ScheduleError) as raised:
        save_entries([*good[:5], bad, good[5]], app=app)
    assert "entry #5 ('bad-tz')" in str(raised.value)
    backend = beat_backend(get_config(app))
    assert set(backend.entry_definitions()) == {"ok-0", "ok-1", "ok-2", "ok-3"}
    assert backend.definition_count() == backend.change_count() == 4


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _seeded(app: Celery, name: str, shards: int = 1) -> tuple[dict[str, Any] | None, float | None]:
    """``name``'s stored state (parsed) and due score, from its shard's backend."""
    backend = beat_backend(get_config(app)).for_shard(shard_of(name, shards))
    (state,), (score,) = backend.read_states([name])
    return (None if state is None else json.loads(state)), score


def test_a_save_plans_the_first_slot_of_each_entry_no_leader_planned(app: Celery) -> None:
    # each new entry gets the state and due time a leader would plan from the save's clock, so that a
    # leader that never ran finds it due; the same bytes whether one save or many wrote it
    items = _mixed()
    saved_at = time.time()
    save_entries(items, app=app)
    for item in items:
        params = {k: v for k, v in item.items() if k not in ("name", "task", "schedule")}
        save_entry(f"single-{item['name']}", item["task"], item["schedule"], app=app, **params)
    # An interval's first slot counts from its save: the single saves come later than the bulk one
    # (a second or more on a loaded machine), so their first slots may come as much later.
    saves_took = time.time() - saved_at
    for item in items:
        name = item["name"]
        info = get_entry(name, app=app)
        assert info is not None
        state, score = _seeded(app, name)
        if not item.get("enabled", True):
            assert (state, score) == (None, None), name  # a paused entry is planned when resumed
            continue
        assert state is not None, name
        assert score is not None, name
        assert state["last"] is None
        assert info.next_fire is not None, name
        assert state["next"] == info.next_fire.timestamp(), name
        single, single_score = _seeded(app, f"single-{name}")
        assert single is not None, name
        if isinstance(item["schedule"], dict) and item["schedule"]["type"] == "crontab":
            assert single == state, name
        else:
            assert {**single, "next": None} == {**state, "next": None}, name
            assert 0 <= single["next"] - state["next"] <= math.ceil(saves_took) + 1, name
        if "jitter" in item:
            assert state["next"] <= score < state["next"] + item["jitter"]
        else:
            assert score == state["next"], name
            assert single_score == single["next"], name


def test_a_changed_entry_is_planned_again_only_while_it_never_fired(app: Celery) -> None:
    save_entry("x", "t.save_noop", 60, app=app)
    first, _ = _seeded(app, "x")
    # edited before any leader fired it: the new schedule's first slot replaces the seed
    save_entries([{"name": "x", "task": "t.save_noop", "schedule": BERLIN_NINE}], app=app)
    edited, score = _seeded(app, "x")
    assert edited is not None
    assert first is not None
    assert edited["sig"] != first["sig"]
    info = get_entry("x", app=app)
    assert info is not None
    assert info.next_fire is not None
    assert score == info.next_fire.timestamp()
    # an unchanged save writes nothing; a name twice in one call: the later one counts
    assert save_entry("x", "t.save_noop", BERLIN_NINE, app=app).version == info.version
    save_entries(
        [{"name": "x", "task": "t.save_noop", "schedule": 30}, {"name": "x", "task": "t.save_noop", "schedule": 90}],
        app=app,
    )
    twice, _ = _seeded(app, "x")
    save_entry("y", "t.save_noop", 90, app=app)
    assert twice is not None
    assert twice["sig"] == _seeded(app, "y")[0]["sig"]
    # a state that fired is the leader's: a save leaves it, and its due time, as they are
    fired = '{"last": 1000.0, "next": 1090.0, "sig": "' + twice["sig"] + '"}'
    backend = beat_backend(get_config(app))
    backend.entry_seed_state("z", fired)
    save_entry("z", "t.save_noop", 60, app=app)
    assert _seeded(app, "z") == (json.loads(fired), None)
    save_entries([{"name": "z", "task": "t.save_noop", "schedule": 30}], app=app)
    assert _seeded(app, "z") == (json.loads(fired), None)


def test_a_sharded_app_plans_each_entry_in_its_shard(
    make_app: Callable[..., Celery], coordination: dict[str, Any]
) -> None:
    shards = 3
    app = make_app(**coordination, safe_time_beat_shards=shards)
    app.task(name="t.save_noop", shared=False)(_noop)
    names = [f"tenant-{i}" for i in range(30)]
    save_entries([{"name": n, "task": "t.save_noop", "schedule": 60} for n in names[:-1]], app=app)
    save_entry(names[-1], "t.save_noop", 60, app=app)
    assert {shard_of(n, shards) for n in names} == {0, 1, 2}
    for name in names:
        state, score = _seeded(app, name, shards)
        assert state is not None, name
        assert score is not None, name
        other = beat_backend(get_config(app)).for_shard((shard_of(name, shards) + 1) % shards)
        assert other.read_states([name]) == ([None], [None]), name


@pytest.fixture
def pg_app(make_app: Callable[..., Celery], postgres_url: str) -> Celery:
    app = make_app(**coordination_settings(postgres_url))
    app.task(name="t.save_noop", shared=False)(_noop)
    return app


def test_postgres_writes_a_bulk_saves_seeds_apart_only_for_the_version_it_saved(pg_app: Celery) -> None:
    # On PostgreSQL a chunk's seeds follow its commit on a connection of their own. A seed that comes
    # after a later save of the same entry (by another caller) must not replace that save's plan.
    backend = beat_backend(get_config(pg_app))
    assert backend.seeds_apart
    save_entry("a", "t.save_noop", 60, app=pg_app)
    stale, stale_score = _seeded(pg_app, "a")
    assert stale is not None
    assert stale_score is not None
    raw = backend.entry_definition("a")
    (late_version,) = backend.entry_save_many([("a", _text(raw).replace('"every":60', '"every":45'))])
    save_entry("a", "t.save_noop", 90, app=pg_app)
    planned = _seeded(pg_app, "a")
    backend.entry_seed_many([("a", (json.dumps(stale), stale_score), late_version)])
    assert _seeded(pg_app, "a") == planned
    # the version the change log holds is written (the state never fired)
    info = get_entry("a", app=pg_app)
    assert info is not None
    backend.entry_seed_many([("a", (json.dumps(stale), stale_score), info.version)])
    assert _seeded(pg_app, "a") == (stale, stale_score)


def test_postgres_a_seed_skips_an_entry_another_save_holds_instead_of_waiting(
    pg_app: Celery, postgres_url: str
) -> None:
    backend = beat_backend(get_config(pg_app))
    save_entry("held", "t.save_noop", 60, app=pg_app)
    seed, score = _seeded(pg_app, "held")
    info = get_entry("held", app=pg_app)
    assert info is not None
    engine = sa.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:  # a save of the same entry in progress holds its change log row
            conn.execute(sa.text("SELECT 1 FROM safe_time_beat_changes WHERE name = 'held' FOR UPDATE"))
            done = threading.Event()
            thread = threading.Thread(
                target=lambda: (backend.entry_seed_many([("held", ('{"last": null, "x": 1}', 1.0), info.version)]),
                                done.set()),
                daemon=True,
            )  # fmt: skip
            thread.start()
            assert done.wait(10), "the seed waited for the row another save holds"
    finally:
        engine.dispose()
    assert _seeded(pg_app, "held") == (seed, score)


def test_postgres_a_seed_that_fails_is_logged_and_the_save_stands(
    pg_app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend_class = type(beat_backend(get_config(pg_app)))

    def broken(self: Any, rows: Any) -> None:
        raise sa.exc.OperationalError("seed_states", {}, Exception("connection lost"))

    monkeypatch.setattr(backend_class, "entry_seed_many", broken)
    monkeypatch.setattr(C, "BEAT_SAVE_CHUNK", 2)
    with caplog.at_level("WARNING", logger="celery_safe_time.beat.entries"):
        assert (
            save_entries([{"name": f"n-{i}", "task": "t.save_noop", "schedule": 60} for i in range(5)], app=pg_app) == 5
        )
    assert [get_entry(f"n-{i}", app=pg_app) is not None for i in range(5)] == [True] * 5
    assert _seeded(pg_app, "n-0") == (None, None)  # planned by the leader from the change log
    assert any("could not plan the first slot of 3 chunk(s)" in m for m in caplog.messages)
