"""Runtime entries: what a fire leaves in Redis (one-offs), pause/resume as a compare-and-set racing
``save_entry``, and solar entries firing at their event. Real Redis, ``SafeScheduler`` in this process,
time injected through the scheduler's ``now`` where an event is hours away."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ephem
import pytest
import redis
from celery import Celery
from celery.schedules import solar

from celery_safe_time import get_entry, list_entries, save_entry
from celery_safe_time.beat.entries import set_enabled
from celery_safe_time.beat.scheduler import SafeScheduler
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

UTC = timezone.utc
ENTRIES = "safe_time:beat:entries"
STATE = "safe_time:beat:state"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    app = make_app(safe_time_beat_lease=3)
    app.task(name="t.state_noop", shared=False)(_noop)
    return app


def _fired(sent: list[dict[str, Any]], name: str) -> list[float]:
    return [s["slot"].timestamp() for s in sent if s["entry"] == name]


def _strict_json(raw: Any) -> Any:
    """JSON as other languages parse it: no ``Infinity`` / ``NaN``."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    assert raw is not None
    return json.loads(raw, parse_constant=refuse)


# --- one-off ------------------------------------------------------------------------------------


def test_a_fired_one_off_stores_valid_json_and_is_disabled_in_its_definition(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], redis_client: redis.Redis
) -> None:
    when = datetime.fromtimestamp(int(time.time()) + 2, UTC)
    save_entry("once", "t.state_noop", when, args=(1,), app=app)
    wait_for(lambda: (leader.tick(), _fired(sent, "once"))[1], 10, interval=0.05)
    leader.tick()  # applies the definition the fire rewrote
    state = _strict_json(redis_client.hget(STATE, "once"))
    assert state["last"] == when.timestamp()
    assert state["next"] is None  # no slot left: null, not Infinity
    definition = _strict_json(redis_client.hget(ENTRIES, "once"))
    assert definition["enabled"] is False
    assert definition["args"] == [1]
    assert definition["schedule"] == {"type": "at", "at": when.isoformat()}
    info = get_entry("once", app=app)
    assert info is not None
    assert (info.enabled, info.next_fire, info.last_fired) == (False, None, when)
    assert [e.enabled for e in list_entries(app=app, prefix="once")] == [False]
    assert "once" in leader.paused
    assert redis_client.zscore("safe_time:beat:due", "once") is None
    for _ in range(5):
        leader.tick()
    assert len(_fired(sent, "once")) == 1


def test_a_one_off_saved_again_with_a_new_instant_is_not_disabled_by_the_old_fire(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], redis_client: redis.Redis
) -> None:
    """The disable is a compare-and-set: a new instant saved before the leader rewrites it is kept."""
    first = datetime.fromtimestamp(int(time.time()) + 1, UTC)
    save_entry("twice", "t.state_noop", first, app=app)
    wait_for(lambda: (leader.tick(), _fired(sent, "twice"))[1], 10, interval=0.05)
    later = datetime.fromtimestamp(int(time.time()) + 2, UTC)
    save_entry("twice", "t.state_noop", later, app=app)  # enabled again, at a new instant
    wait_for(lambda: (leader.tick(), len(_fired(sent, "twice")) >= 2)[1], 10, interval=0.05)
    assert _fired(sent, "twice") == [first.timestamp(), later.timestamp()]
    leader.tick()
    definition = _strict_json(redis_client.hget(ENTRIES, "twice"))
    assert definition["schedule"]["at"] == later.isoformat()
    assert definition["enabled"] is False


# --- pause / resume against a concurrent save ------------------------------------------------------


def test_pause_and_resume_never_undo_a_concurrent_save(app: Celery, redis_client: redis.Redis) -> None:
    """One thread pauses and resumes, another saves a new schedule each round. A read-modify-write
    pause (read the definition, write it back with enabled flipped) that straddles a save writes the
    old schedule back: the saver then finds its own schedule gone. A compare-and-set never does."""
    save_entry("raced", "t.state_noop", 1, app=app)
    rounds = 150
    done = threading.Event()
    errors: list[str] = []
    toggles = 0

    def toggle() -> None:
        nonlocal toggles
        enabled = False
        while not done.is_set():
            set_enabled("raced", enabled, app=app)
            enabled = not enabled
            toggles += 1

    toggler = threading.Thread(target=toggle)
    toggler.start()
    try:
        for k in range(1, rounds + 1):
            stored = _strict_json(redis_client.hget(ENTRIES, "raced"))["schedule"]
            if stored != {"type": "interval", "every": float(k)}:
                errors.append(f"round {k}: the schedule saved last was every {k} s, stored: {stored}")
            save_entry("raced", "t.state_noop", k + 1, app=app)
    finally:
        done.set()
        toggler.join(30)
    assert toggles > rounds / 10, "the toggler hardly ran: no race was exercised"
    assert errors == []
    final = _strict_json(redis_client.hget(ENTRIES, "raced"))
    assert final["schedule"] == {"type": "interval", "every": float(rounds + 1)}
    # every write went through the change log: the leader sees each one
    assert redis_client.zscore("safe_time:beat:entries:changed", "raced") == float(
        redis_client.get("safe_time:beat:entries:version") or 0
    )


def test_pause_of_a_missing_entry_is_none_and_a_paused_entry_keeps_its_definition(
    app: Celery, redis_client: redis.Redis
) -> None:
    assert set_enabled("nobody", False, app=app) is None
    save_entry("kept", "t.state_noop", 7, args=("a",), kwargs={"k": 1}, options={"queue": "q"}, app=app)
    version = redis_client.get("safe_time:beat:entries:version")
    paused = set_enabled("kept", False, app=app)
    assert paused is not None
    assert not paused.enabled
    assert (paused.args, paused.kwargs, paused.options) == (("a",), {"k": 1}, {"queue": "q"})
    assert set_enabled("kept", False, app=app) is not None  # already paused: no new version
    assert int(redis_client.get("safe_time:beat:entries:version") or 0) == int(version or 0) + 1


# --- solar --------------------------------------------------------------------------------------

BERLIN = (52.52, 13.405)


def _sunrise_after(ts: float) -> float:
    """Sunrise in Berlin after ``ts`` by ephem directly (celery's observer: horizon -0:34, no refraction)."""
    observer = ephem.Observer()
    observer.lat, observer.lon = str(BERLIN[0]), str(BERLIN[1])
    observer.elev, observer.pressure, observer.horizon = 0, 0, "-0:34"
    found = observer.next_rising(ephem.Sun(), start=ephem.Date(datetime.fromtimestamp(ts, UTC)))
    return float(found.datetime().replace(tzinfo=UTC).timestamp())


def test_a_solar_entry_fires_at_sunrise_once_and_then_the_next_day(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], redis_client: redis.Redis
) -> None:
    save_entry("dawn", "t.state_noop", solar("sunrise", *BERLIN), app=app)
    leader.tick()
    info = get_entry("dawn", app=app)
    assert info is not None
    assert info.next_fire is not None
    expected = _sunrise_after(time.time())
    assert abs(info.next_fire.timestamp() - expected) < 1.0
    slot = info.next_fire.timestamp()
    epoch = leader.keeper.epoch
    assert epoch is not None

    def due_at(now: float) -> list[tuple[str, float]]:
        due, lost, _, _ = leader._read_due(now)
        assert lost is None
        return [(name, score) for name, score in due if name == "dawn"]

    # the scheduler's clock injected: a second before sunrise nothing is due, just after it fires
    assert due_at(slot - 1.0) == []
    now = slot + 0.5
    assert leader.fire_due(due_at(now), now, epoch)
    assert _fired(sent, "dawn") == [slot]
    # the next slot is the next day's sunrise, not a second after this one
    after = get_entry("dawn", app=app)
    assert after is not None
    assert after.next_fire is not None
    assert abs(after.next_fire.timestamp() - _sunrise_after(slot + 60)) < 1.0
    assert after.next_fire.timestamp() - slot > 20 * 3600
    for later in (slot + 1.5, slot + 5, slot + 3600):
        assert leader.fire_due(due_at(later), later, epoch)
    assert _fired(sent, "dawn") == [slot]


# --- a new leader's first tick --------------------------------------------------------------------


def _leader(app: Celery, path: Path) -> SafeScheduler:
    sched = SafeScheduler(app=app, schedule_filename=str(path), max_interval=1)
    wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
    return sched


def test_a_new_leader_replans_only_what_changed_after_the_last_leader(
    app: Celery, tmp_path: Path, sent: list[dict[str, Any]], redis_client: redis.Redis, caplog: Any
) -> None:
    for i in range(50):
        save_entry(f"day-{i}", "t.state_noop", 86400, app=app)
    save_entry("fast", "t.state_noop", 1, app=app)
    first = _leader(app, tmp_path / "1")
    try:
        first.tick()
        wait_for(lambda: (first.tick(), _fired(sent, "fast"))[1], 10, interval=0.05)
    finally:
        first.close()
    applied = redis_client.get("safe_time:beat:entries:applied")
    assert applied is not None
    assert applied.split(b" ")[0] == redis_client.get("safe_time:beat:entries:version")
    states_before = redis_client.hgetall(STATE)
    # while no beat leads: one edit, one deletion, one new entry
    save_entry("day-0", "t.state_noop", 3600, app=app)
    from celery_safe_time import delete_entry

    assert delete_entry("day-1", app=app)
    save_entry("new", "t.state_noop", 2, app=app)
    caplog.set_level("INFO", logger="celery_safe_time.beat.replan")
    second = _leader(app, tmp_path / "2")
    try:
        second.tick()
        line = next(r.getMessage() for r in caplog.records if "leader with epoch" in r.getMessage())
        assert "re-planned changes after version" in line, line
        # the edit of day-0 (which fired: its state is the leader's); the new entry was planned by its save
        assert "1 new or edited" in line, line
        assert "1 removed" in line, line
        assert redis_client.hget(STATE, "day-1") is None
        assert redis_client.zscore("safe_time:beat:due", "day-1") is None
        assert redis_client.zscore("safe_time:beat:entries:changed", "day-1") is None  # tombstone pruned
        assert redis_client.zscore("safe_time:beat:due", "new") is not None
        after = redis_client.hgetall(STATE)
        untouched = [n for n in states_before if n not in (b"day-0", b"day-1", b"fast")]
        assert all(after[n] == states_before[n] for n in untouched)
        last_fast = _fired(sent, "fast")[-1]
        wait_for(lambda: (second.tick(), _fired(sent, "fast")[-1] > last_fast)[1], 10, interval=0.05)
    finally:
        second.close()
    slots = _fired(sent, "fast")
    assert len(slots) == len(set(slots))


def test_a_new_leader_replans_everything_when_the_due_set_does_not_add_up(
    app: Celery, tmp_path: Path, redis_client: redis.Redis, caplog: Any
) -> None:
    for i in range(5):
        save_entry(f"e-{i}", "t.state_noop", 60, app=app)
    first = _leader(app, tmp_path / "1")
    try:
        first.tick()
    finally:
        first.close()
    # an entry's due member lost while no beat ran (eviction, a DEL by hand)
    redis_client.zrem("safe_time:beat:due", "e-3")
    caplog.set_level("INFO", logger="celery_safe_time.beat.replan")
    second = _leader(app, tmp_path / "2")
    try:
        second.tick()
    finally:
        second.close()
    line = next(r.getMessage() for r in caplog.records if "leader with epoch" in r.getMessage())
    assert "re-planned full" in line, line
    assert redis_client.zscore("safe_time:beat:due", "e-3") is not None
    # a member no entry owns (a beat_schedule entry removed by a deploy): a full re-plan drops it
    redis_client.zadd("safe_time:beat:due", {"removed-from-config": 1.0})
    redis_client.hset(STATE, "removed-from-config", '{"last": null, "next": 1.0, "sig": "every 60s"}')
    caplog.clear()
    again = _leader(app, tmp_path / "2b")
    try:
        again.tick()
    finally:
        again.close()
    line = next(r.getMessage() for r in caplog.records if "leader with epoch" in r.getMessage())
    assert "re-planned full" in line, line
    assert redis_client.zscore("safe_time:beat:due", "removed-from-config") is None
    assert redis_client.hget(STATE, "removed-from-config") is None
    # another planning fingerprint (the app timezone moves plain crontabs): a full re-plan too
    redis_client.set("safe_time:beat:entries:applied", b"999 format=1;celery=0;tz=UTC")
    caplog.clear()
    third = _leader(app, tmp_path / "3")
    try:
        third.tick()
    finally:
        third.close()
    line = next(r.getMessage() for r in caplog.records if "leader with epoch" in r.getMessage())
    assert "re-planned full" in line, line
