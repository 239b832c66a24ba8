"""``save_entries`` on Redis and PostgreSQL coordination: the bytes, versions, audit records and
counts of a bulk save are those of one ``save_entry`` after the other, the unchanged entries of a
re-import write nothing, and a bad entry stores nothing of its chunk."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import entry_audit, save_entries, save_entry
from celery_safe_time.beat.backends import beat_backend
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError

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
