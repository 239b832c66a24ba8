"""Backfill on the in-memory beat backend, time injected: the slots of a range, each published once
(also when run twice or after the leader fired some), the limit and the bad input refused by name."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_safe_time import constants as C
from celery_safe_time.beat import entries as beat_entries
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.backfill import backfill, backfill_slots, run_backfill
from celery_safe_time.beat.slots import CronGrid, IntervalGrid
from celery_safe_time.beat.state import dump_state
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError
from celery_safe_time.locks.backends import use_lock_backend
from celery_safe_time.locks.backends.memory import MemoryLockBackend
from celery_safe_time.schedules import crontab

UTC = dt.timezone.utc
NOW = dt.datetime(2027, 1, 15, 12, 30, tzinfo=UTC)


@pytest.fixture
def data(monkeypatch: pytest.MonkeyPatch) -> MemoryBeatData:
    shared = MemoryBeatData(now=lambda: NOW.timestamp())
    monkeypatch.setattr(beat_entries, "beat_backend", lambda config: MemoryBeatBackend(config, shared))
    return shared


@pytest.fixture
def app(data: MemoryBeatData) -> Celery:
    app = Celery("backfill", set_as_current=False, broker="memory://")
    app.conf.safe_time_redis_url = "redis://127.0.0.1:6379/15"  # never connected to: the memory backend
    task = f"t.record.{uuid.uuid4().hex[:8]}"  # task names are unique across apps
    app.conf.beat_schedule = {
        "hourly": {"task": task, "schedule": crontab(minute="0"), "args": [1], "options": {"queue": "q"}},
        "every-10": {"task": task, "schedule": 10.0},
        "nightly": {"task": task, "schedule": crontab(minute="0"), "options": {"safe_time_overlap": "skip"}},
    }

    @app.task(name=task)
    def record(*args: Any) -> None:
        pass

    return app


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []

    def on_publish(sender: Any = None, headers: Any = None, routing_key: Any = None, **kw: Any) -> None:
        out.append({"task": sender, "routing_key": routing_key, **(headers or {})})

    before_task_publish.connect(on_publish, weak=False)
    yield out
    before_task_publish.disconnect(on_publish)


def test_a_cron_grid_gives_the_slots_of_the_half_open_range() -> None:
    grid = CronGrid(crontab(minute="0", tz="UTC"))
    start = dt.datetime(2027, 1, 1, 0, tzinfo=UTC).timestamp()
    slots = backfill_slots(grid, start, start + 24 * 3600, limit=24)
    assert slots == [start + h * 3600 for h in range(24)]
    with pytest.raises(ScheduleError, match="24 slots in the range, more than the limit of 23"):
        backfill_slots(grid, start, start + 24 * 3600, limit=23)


def test_an_interval_grid_keeps_the_leaders_anchor() -> None:
    grid = IntervalGrid(10.0)
    assert backfill_slots(grid, 100.0, 140.0, limit=10, anchor=1003.0) == [103.0, 113.0, 123.0, 133.0]
    with pytest.raises(ScheduleError, match="4 slots in the range, more than the limit of 3"):
        backfill_slots(grid, 100.0, 140.0, limit=3, anchor=1003.0)
    with pytest.raises(ScheduleError, match="where the beat leader first planned it"):
        backfill_slots(grid, 100.0, 140.0, limit=10)


def test_backfill_publishes_each_slot_once_with_its_slot_header(
    app: Celery, data: MemoryBeatData, published: list[dict[str, Any]]
) -> None:
    start, end = NOW - dt.timedelta(hours=24, minutes=30), NOW - dt.timedelta(minutes=30)
    # the leader fired one slot of the range already
    fired = dt.datetime(2027, 1, 15, 3, tzinfo=UTC).timestamp()
    data.fired[("hourly", str(round(fired * 1000)))] = NOW.timestamp() + C.FIRED_SLOT_TTL
    first = backfill("hourly", start, end, app=app)
    assert len(first) == 23
    assert dt.datetime.fromtimestamp(fired, UTC) not in first
    assert [p[C.HEADER_SLOT] for p in published] == [slot.isoformat() for slot in first]
    assert {p["routing_key"] for p in published} == {"q"}
    assert all(p[C.HEADER_BACKFILL].startswith("backfill:") for p in published)
    assert backfill("hourly", start, end, app=app) == []
    assert len(published) == 23


def test_an_interval_entry_is_backfilled_on_the_grid_the_leader_planned(app: Celery, data: MemoryBeatData) -> None:
    anchor = NOW.timestamp() + 3  # the leader's next slot: the grid is ... -17, -7, +3
    data.states["every-10"] = dump_state(None, anchor, IntervalGrid(10.0).signature())
    slots = backfill("every-10", NOW - dt.timedelta(seconds=30), NOW, app=app)
    assert [s.timestamp() - NOW.timestamp() for s in slots] == [-27.0, -17.0, -7.0]


def test_bad_input_is_refused_by_name(app: Celery, data: MemoryBeatData) -> None:
    hour = dt.timedelta(hours=1)
    with pytest.raises(ScheduleError, match="is not after the start"):
        backfill("hourly", NOW - hour, NOW - hour, app=app)
    with pytest.raises(ScheduleError, match="no beat entry 'nope'"):
        backfill("nope", NOW - hour, NOW, app=app)
    with pytest.raises(ScheduleError, match="is in the future"):
        backfill("hourly", NOW - hour, NOW + hour, app=app)
    with pytest.raises(ScheduleError, match="fired slots are remembered 7 days"):
        backfill("hourly", NOW - dt.timedelta(days=7), NOW, app=app)
    with pytest.raises(ScheduleError, match="25 slots in the range, more than the limit of 10"):
        backfill("hourly", NOW - 25 * hour, NOW, app=app, limit=10)
    with pytest.raises(ScheduleError, match="where the beat leader first planned it"):
        backfill("every-10", NOW - hour, NOW, app=app)
    naive = (NOW - 2 * hour).replace(tzinfo=None)  # naive means UTC
    assert len(backfill("hourly", naive, NOW, app=app)) == 2
    assert data.fired


@pytest.fixture
def locks(app: Celery) -> Iterator[MemoryLockBackend]:
    store = MemoryLockBackend(get_config(app), clock=lambda: NOW.timestamp())
    use_lock_backend(app, store)
    yield store
    use_lock_backend(app, None)


SIX_HOURS = (NOW - dt.timedelta(hours=6, minutes=30), NOW - dt.timedelta(minutes=30))


@pytest.mark.parametrize(
    ("overlap", "published_slots"),
    [
        # every slot, the runs may overlap: no overlap header, no id chosen for them
        ("allow", [0, 1, 2, 3, 4, 5]),
        # every slot, each run chained behind the one before
        ("buffer_all", [0, 1, 2, 3, 4, 5]),
        # the first slot, then the rest find it queued
        ("skip", [0]),
        ("buffer_one", [0]),
        # each slot revokes the one before (the revokes go to the broker: the memory one here)
        ("cancel_other", [0, 1, 2, 3, 4, 5]),
    ],
)
def test_a_backfill_goes_through_the_overlap_policy_it_names(
    app: Celery,
    data: MemoryBeatData,
    locks: MemoryLockBackend,
    published: list[dict[str, Any]],
    overlap: str,
    published_slots: list[int],
) -> None:
    result = run_backfill("hourly", *SIX_HOURS, app=app, overlap=overlap)
    first = dt.datetime(2027, 1, 15, 6, tzinfo=UTC)
    assert result.published == [first + dt.timedelta(hours=h) for h in published_slots]
    assert len(result.published) + len(result.dropped) == 6
    headers = [p.get(C.HEADER_OVERLAP) for p in published]
    if overlap == "allow":
        assert headers == [None] * 6
        return
    assert all(h is not None and h["policy"] == overlap for h in headers), headers
    if overlap == "buffer_all":
        ids = [p["id"] for p in published]
        assert [h.get("after") for h in headers] == [None, *ids[:-1]]
    # a dropped slot stays fired: a second backfill publishes nothing
    assert run_backfill("hourly", *SIX_HOURS, app=app, overlap=overlap).published == []


def test_a_backfill_takes_the_entrys_own_policy_unless_it_names_one(
    app: Celery, data: MemoryBeatData, locks: MemoryLockBackend, published: list[dict[str, Any]]
) -> None:
    assert len(run_backfill("nightly", *SIX_HOURS, app=app).published) == 1
    assert len(published) == 1
    with pytest.raises(ScheduleError, match="must be one of allow, skip, buffer_one, buffer_all, cancel_other"):
        run_backfill("hourly", *SIX_HOURS, app=app, overlap="sometimes")
    assert len(published) == 1  # refused before any slot was claimed
    assert run_backfill("hourly", *SIX_HOURS, app=app, overlap="allow").published != []
