"""``page_entries`` and ``count_entries`` on the in-memory beat backend, time injected: name order
across config and runtime entries, the prefix, each state filter, the cursor at the end, the scan
budget of a filter, and the counts from the backend's index."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery

from celery_safe_time.beat import entries as beat_entries
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.definitions import definition_json
from celery_safe_time.beat.entry_pages import EntriesPage, count_entries, merge_pages, page_entries

NOW = 1_800_000_000.0
EVERY_MINUTE = {"type": "interval", "every": 60.0}


@pytest.fixture
def data(monkeypatch: pytest.MonkeyPatch) -> MemoryBeatData:
    shared = MemoryBeatData(now=lambda: NOW)
    monkeypatch.setattr(beat_entries, "beat_backend", lambda config: MemoryBeatBackend(config, shared))
    return shared


@pytest.fixture
def task() -> str:
    return f"t.page.{uuid.uuid4().hex[:8]}"  # task names are unique across apps


@pytest.fixture
def app(data: MemoryBeatData, task: str) -> Celery:
    app = Celery("pages", set_as_current=False, broker="memory://")
    app.conf.safe_time_redis_url = "redis://127.0.0.1:1/0"  # never connected to: the memory backend
    app.conf.timezone = "UTC"
    app.conf.beat_schedule = {"b-config": {"task": task, "schedule": 30.0}}

    @app.task(name=task)
    def record() -> None:
        pass

    return app


def _store(data: MemoryBeatData, name: str, task: str, *, enabled: bool = True, due: float | None = None) -> None:
    data.definitions[name] = definition_json(name, task, EVERY_MINUTE, [], {}, {}, enabled)
    if due is not None:
        data.due[name] = due


def _names(page: EntriesPage) -> list[str]:
    return [info.name for info in page.entries]


def test_pages_follow_name_order_across_config_and_runtime_entries(
    app: Celery, data: MemoryBeatData, task: str
) -> None:
    for name in ("c-3", "a-1", "c-1", "b-2", "a-2"):
        _store(data, name, task)
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page = page_entries(app=app, after=after, limit=2)
        pages += 1
        seen += _names(page)
        if page.after is None:
            break
        assert _names(page)[-1] == page.after
        after = page.after
    assert seen == ["a-1", "a-2", "b-2", "b-config", "c-1", "c-3"]
    assert pages == 3


def test_the_cursor_at_the_end_gives_an_empty_last_page(app: Celery, data: MemoryBeatData, task: str) -> None:
    _store(data, "x-1", task)
    page = page_entries(app=app, after="x-1", limit=5)
    assert page.entries == []
    assert page.after is None
    # a page that ends exactly on the last name says there is none after it
    whole = page_entries(app=app, limit=2)
    assert _names(whole) == ["b-config", "x-1"]
    assert whole.after is None


def test_a_prefix_keeps_its_names_only(app: Celery, data: MemoryBeatData, task: str) -> None:
    for name in ("tenant-1", "tenant-2", "tenant-10", "tenants", "other"):
        _store(data, name, task)
    assert _names(page_entries(app=app, prefix="tenant-")) == ["tenant-1", "tenant-10", "tenant-2"]
    first = page_entries(app=app, prefix="tenant-", limit=1)
    assert _names(first) == ["tenant-1"]
    assert _names(page_entries(app=app, prefix="tenant-", after=first.after)) == ["tenant-10", "tenant-2"]
    assert _names(page_entries(app=app, prefix="b-")) == ["b-config"]


def test_each_state_filter(app: Celery, data: MemoryBeatData, task: str) -> None:
    _store(data, "on", task, due=NOW + 10)
    _store(data, "later", task, due=NOW + 3600)
    _store(data, "off", task, enabled=False)
    data.definitions["broken"] = definition_json("broken", "no.such.task", EVERY_MINUTE, [], {}, {}, True)
    assert _names(page_entries(app=app, state="active")) == ["b-config", "later", "on"]
    assert _names(page_entries(app=app, state="paused")) == ["off"]
    invalid = page_entries(app=app, state="invalid")
    assert _names(invalid) == ["broken"]
    assert "no.such.task" in invalid.invalid["broken"]
    # without the task check (a web process), the unknown task is no reason
    assert _names(page_entries(app=app, state="invalid", tasks=False)) == []
    assert _names(page_entries(app=app, state="due-soon", soon=60)) == ["on"]
    assert _names(page_entries(app=app, state="due-soon", soon=7200)) == ["later", "on"]
    assert page_entries(app=app, state="due-soon", soon=7200, limit=1).after == "later"


def test_a_filter_stops_at_its_scan_budget_and_names_where_to_go_on(
    app: Celery, data: MemoryBeatData, task: str
) -> None:
    for i in range(30):
        _store(data, f"n-{i:02d}", task, enabled=i != 25)
    page = page_entries(app=app, state="paused", scan=10)
    assert page.entries == []
    assert page.scanned >= 10
    assert page.after is not None
    found: list[str] = []
    after = page.after
    while after is not None:
        page = page_entries(app=app, state="paused", scan=10, after=after)
        found += _names(page)
        after = page.after
    assert found == ["n-25"]


def test_counts_come_from_the_backend(app: Celery, data: MemoryBeatData, task: str) -> None:
    _store(data, "soon", task, due=NOW + 5)
    _store(data, "later", task, due=NOW + 5000)
    _store(data, "off", task, enabled=False)
    data.due["b-config"] = NOW + 20
    assert count_entries(app, soon=60) == {"config": 1, "runtime": 3, "scheduled": 3, "due_soon": 2, "soon_s": 60}


def test_merging_two_sources_ends_where_the_first_that_goes_on_ends() -> None:
    first = [("a", 1), ("c", 3)]
    second = [("b", 2), ("d", 4)]
    # the first source goes on after "c": "d" would skip whatever it holds between "c" and "d"
    assert merge_pages(first, "c", second, 4) == ([("a", 1), ("b", 2), ("c", 3)], "c")
    assert merge_pages(first, None, second, 4) == ([("a", 1), ("b", 2), ("c", 3), ("d", 4)], None)
    # the second is a full page: it may go on after "b"
    assert merge_pages(first, None, second[:1], 1) == ([("a", 1)], "a")
    assert merge_pages([], None, [], 3) == ([], None)
