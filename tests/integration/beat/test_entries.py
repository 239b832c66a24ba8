"""Runtime entries on each beat backend (``coordination``: Redis, PostgreSQL), with ``SafeScheduler``
driven tick by tick in this process."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from dateutil.rrule import SECONDLY
from dateutil.rrule import rrule as dateutil_rrule

from celery_safe_time import (
    EntryInfo,
    crontab,
    delete_entry,
    get_entry,
    list_entries,
    save_entries,
    save_entry,
    signals,
)
from celery_safe_time.beat.backends import BeatBackend, beat_backend
from celery_safe_time.beat.entries import run_now, run_now_fired, set_enabled
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError, SerializationError
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

UTC = timezone.utc


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def app(make_app: Callable[..., Celery], coordination: dict[str, Any]) -> Celery:
    app = make_app(
        # no test here waits for a lease to run out; a 3 s one ran out under a loaded CI (the
        # in-process leader stood by mid-test and planned nothing)
        safe_time_beat_lease=10,
        beat_schedule={"cfg": {"task": "t.entries_noop", "schedule": 3600.0, "args": ("c",)}},
        **coordination,
    )
    app.task(name="t.entries_noop", shared=False)(_noop)
    app.task(name="reports.send", shared=False)(_noop)
    return app


@pytest.fixture
def backend(app: Celery) -> BeatBackend:
    """The app's beat backend, to look at what is stored (Redis keys or PostgreSQL rows)."""
    return beat_backend(get_config(app))


def _text(raw: Any) -> Any:
    return raw.decode() if isinstance(raw, bytes) else raw


def _scheduled(backend: BeatBackend, name: str) -> tuple[Any, float | None]:
    """``name``'s stored state and due score (None where absent)."""
    (state,), (score,) = backend.read_states([name])
    return _text(state), score


def _logged(backend: BeatBackend) -> set[str]:
    return {name for name, _ in backend.change_log()}


def _fired(sent: list[dict[str, Any]], name: str) -> list[float]:
    return [s["slot"].timestamp() for s in sent if s["entry"] == name]


def _tick_until(sched: SafeScheduler, predicate: Callable[[], Any], timeout: float = 10) -> Any:
    return wait_for(lambda: (sched.tick(), predicate())[1], timeout, interval=0.05)


def test_save_get_list_delete(app: Celery, backend: BeatBackend) -> None:
    info = save_entry(
        "tenant-42-report",
        "reports.send",
        crontab(minute=0, hour=9, tz="Europe/Berlin"),
        args=(42,),
        kwargs={},
        options={"queue": "reports"},
        enabled=True,
        app=app,
    )
    assert isinstance(info, EntryInfo)
    assert (info.name, info.task, info.args, info.options, info.source) == (
        "tenant-42-report",
        "reports.send",
        (42,),
        {"queue": "reports"},
        "runtime",
    )
    assert info.enabled
    assert info.last_fired is None  # no leader has planned it yet
    assert info.version == 1
    assert isinstance(info.schedule, crontab)
    save_entry("tenant-43-report", "reports.send", 60, app=app)
    save_entry("other", "reports.send", 60, app=app)
    names = [(e.name, e.source) for e in list_entries(app=app)]
    assert names == [
        ("cfg", "config"),
        ("other", "runtime"),
        ("tenant-42-report", "runtime"),
        ("tenant-43-report", "runtime"),
    ]
    assert [e.name for e in list_entries(app=app, prefix="tenant-")] == ["tenant-42-report", "tenant-43-report"]
    assert get_entry("cfg", app=app) is not None
    assert get_entry("missing", app=app) is None
    assert delete_entry("tenant-43-report", app=app) is True
    assert delete_entry("tenant-43-report", app=app) is False
    assert get_entry("tenant-43-report", app=app) is None
    # the stored definition is plain JSON another language can write
    raw = _text(backend.entry_definition("tenant-42-report"))
    assert raw is not None
    assert '"tz":"Europe/Berlin"' in raw


def test_save_entry_returns_the_next_fire_the_leader_then_plans(app: Celery, tmp_path: Path) -> None:
    # No beat runs yet: next_fire is computed at save time, as the leader will plan it.
    info = save_entry("tenant-42-report", "reports.send", crontab(minute=0, hour=9, tz="Europe/Berlin"), app=app)
    assert info.next_fire is not None
    assert info.next_fire > datetime.now(UTC)
    assert (info.next_fire.astimezone(crontab(tz="Europe/Berlin").tz).hour, info.next_fire.minute) == (9, 0)
    every = save_entry("every-minute", "reports.send", 60, app=app)
    assert every.next_fire is not None
    assert abs((every.next_fire - datetime.now(UTC)).total_seconds()) < 2
    assert get_entry("tenant-42-report", app=app) == info
    assert [e.next_fire for e in list_entries(app=app, prefix="tenant-")] == [info.next_fire]
    paused = save_entry("paused", "reports.send", 60, enabled=False, app=app)
    assert paused.next_fire is None

    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        sched.tick()
    finally:
        sched.close()
    applied = get_entry("tenant-42-report", app=app)
    assert applied is not None
    assert applied.next_fire == info.next_fire


def test_invalid_input_fails_inside_save_entry_and_stores_nothing(app: Celery, backend: BeatBackend) -> None:
    with pytest.raises(ScheduleError, match=r"unknown task 'no\.such\.task'"):
        save_entry("x", "no.such.task", 60, app=app)
    with pytest.raises(ScheduleError, match="hour"):
        save_entry("x", "reports.send", {"type": "crontab", "minute": "0", "hour": "24"}, app=app)
    with pytest.raises(ScheduleError, match="unsupported schedule"):
        save_entry("x", "reports.send", "every day", app=app)
    with pytest.raises(ScheduleError, match="never occurs"):
        save_entry("x", "reports.send", {"type": "crontab", "minute": "0", "hour": "0", "day_of_month": "31",
                                         "month_of_year": "2"}, app=app)  # fmt: skip
    ended = dateutil_rrule(SECONDLY, dtstart=datetime(2020, 1, 1, tzinfo=UTC), count=1)
    with pytest.raises(ScheduleError, match="never fires again"):
        save_entry("x", "reports.send", ended, app=app)
    with pytest.raises(SerializationError, match="args"):
        save_entry("x", "reports.send", 60, args=(object(),), app=app)
    for name in ("two\nlines", "tab\there", "nul\x00", "bell\x07"):
        with pytest.raises(ScheduleError, match="control character"):
            save_entry(name, "reports.send", 60, app=app)
    with pytest.raises(ScheduleError, match="safe_time_misfire"):
        save_entry("x", "reports.send", 60, options={"safe_time_misfire": "sometimes"}, app=app)
    # named like the config entry: refused, naming both
    with pytest.raises(ScheduleError, match=r"runtime entry 'cfg' \(task 'reports.send'\).*config entry 'cfg'"):
        save_entry("cfg", "reports.send", 60, app=app)
    assert backend.entry_definitions() == {}
    assert backend.change_log() == []


def test_add_fires_at_the_next_tick_and_unchanged_upserts_keep_state(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], backend: BeatBackend
) -> None:
    saved = time.time()
    save_entry("every2", "t.entries_noop", 2, args=("r",), app=app)
    _tick_until(leader, lambda: _fired(sent, "every2"))
    assert time.time() - saved < 2.0  # an interval entry fires at its first tick
    before = get_entry("every2", app=app)
    assert before is not None
    assert before.last_fired is not None
    assert before.next_fire is not None
    version = backend.read_due(0.0, 1).version

    # six processes saving the same entry at start-up: one schedule, no extra fire, state kept
    barrier = threading.Barrier(6)

    def save() -> None:
        barrier.wait()
        save_entry("every2", "t.entries_noop", 2, args=("r",), app=app)

    threads = [threading.Thread(target=save) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.read_due(0.0, 1).version == version
    after = get_entry("every2", app=app)
    assert after is not None
    assert (after.last_fired, after.next_fire) == (before.last_fired, before.next_fire)
    time.sleep(2.2)
    leader.tick()
    slots = _fired(sent, "every2")
    assert len(slots) == len(set(slots))
    assert all(b - a == 2 for a, b in itertools.pairwise(slots))


def test_change_pause_resume_remove(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], backend: BeatBackend
) -> None:
    save_entry("e", "t.entries_noop", 1, app=app)
    _tick_until(leader, lambda: len(_fired(sent, "e")) >= 2)
    last = _fired(sent, "e")[-1]

    # a changed schedule: the new grid continues after the last fired slot
    save_entry("e", "t.entries_noop", 5, app=app)
    leader.tick()
    info = get_entry("e", app=app)
    assert info is not None
    assert info.next_fire is not None
    assert info.next_fire.timestamp() == last + 5

    # pause: nothing fires, state kept (last fired and the next slot stay in the state hash)
    set_enabled("e", False, app=app)
    leader.tick()
    paused = get_entry("e", app=app)
    assert paused is not None
    assert not paused.enabled
    assert paused.next_fire is None
    assert paused.last_fired is not None
    assert paused.last_fired.timestamp() == last
    assert _scheduled(backend, "e")[1] is None
    count = len(_fired(sent, "e"))
    deadline = time.time() + 6
    while time.time() < deadline:
        leader.tick()
        time.sleep(0.1)
    assert len(_fired(sent, "e")) == count

    # resume: the same grid (last + 5k), at its next slot only: the slot that fell during the pause
    # is not caught up (run_once would have published it at once)
    resumed_at = leader.clock.time()
    info = set_enabled("e", True, app=app)
    assert info is not None
    assert info.next_fire is not None
    assert info.next_fire.timestamp() > resumed_at  # planned as the leader then plans it
    _tick_until(leader, lambda: len(_fired(sent, "e")) > count)
    resumed = _fired(sent, "e")[count:]
    assert len(resumed) == 1
    assert (resumed[0] - last) % 5 == 0
    assert resumed[0] > resumed_at
    assert resumed[0] == info.next_fire.timestamp()

    # remove: nothing more, and the state is gone
    assert delete_entry("e", app=app)
    leader.tick()
    count = len(_fired(sent, "e"))
    assert _scheduled(backend, "e") == (None, None)
    deadline = time.time() + 5.5
    while time.time() < deadline:
        leader.tick()
        time.sleep(0.1)
    assert len(_fired(sent, "e")) == count


def test_a_new_leader_loads_every_runtime_entry_and_keeps_their_state(
    app: Celery, tmp_path: Path, sent: list[dict[str, Any]], backend: BeatBackend
) -> None:
    save_entry("a", "t.entries_noop", 1, app=app)
    save_entry("p", "t.entries_noop", 1, enabled=False, app=app)
    save_entry("gone", "t.entries_noop", 1, app=app)
    first = SafeScheduler(app=app, schedule_filename=str(tmp_path / "1"), max_interval=1)
    try:
        wait_for(lambda: first.keeper.is_leader, 10)
        _tick_until(first, lambda: _fired(sent, "a") and _fired(sent, "gone"))
    finally:
        first.close()
    assert delete_entry("gone", app=app)  # while no beat runs
    assert "gone" in _logged(backend)  # tombstone
    last_a = _fired(sent, "a")[-1]
    second = SafeScheduler(app=app, schedule_filename=str(tmp_path / "2"), max_interval=1)
    try:
        wait_for(lambda: second.keeper.is_leader, 10)
        _tick_until(second, lambda: _fired(sent, "a")[-1] > last_a)
        assert set(second.plans) == {"cfg", "a"}
        assert set(second.paused) == {"p"}
    finally:
        second.close()
    slots = _fired(sent, "a")
    assert len(slots) == len(set(slots))
    assert _scheduled(backend, "gone") == (None, None)
    assert "gone" not in _logged(backend)  # pruned by the reconcile
    assert _fired(sent, "p") == []


def test_one_off_fires_once_then_reports_disabled(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]]
) -> None:
    when = datetime.fromtimestamp(int(time.time()) + 2, UTC)
    save_entry("once", "t.entries_noop", when, app=app)
    _tick_until(leader, lambda: _fired(sent, "once"))
    assert _fired(sent, "once") == [when.timestamp()]
    for _ in range(10):
        leader.tick()
        time.sleep(0.1)
    assert len(_fired(sent, "once")) == 1
    info = get_entry("once", app=app)
    assert info is not None
    assert not info.enabled
    assert info.next_fire is None
    assert info.last_fired == when
    # the same definition saved again (a restart of the process that made it) does not fire it again
    save_entry("once", "t.entries_noop", when, app=app)
    leader.tick()
    assert len(_fired(sent, "once")) == 1


def test_rrule_searches_are_bounded_on_save_and_list(app: Celery, backend: BeatBackend) -> None:
    never = {"type": "rrule", "rule": "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30", "dtstart": "2026-01-01T09:00:07"}
    began = time.thread_time()  # CPU time: what the search costs, whatever the load
    with pytest.raises(ScheduleError, match="never fires again"):
        save_entry("feb30", "reports.send", never, app=app)
    # dateutil alone walks to the year 9999 first: 2.9 s of CPU; the bounded search ~0.3 s.
    assert time.thread_time() - began < 1.5
    far = {"type": "rrule", "rule": "FREQ=YEARLY;BYMONTH=6", "dtstart": "3500-06-01T09:00:00"}
    save_entry("far", "reports.send", far, app=app)
    info = get_entry("far", app=app)
    assert info is not None
    assert info.next_fire == datetime(3500, 6, 1, 9, tzinfo=UTC)
    assert [e.next_fire for e in list_entries(app=app) if e.name == "far"] == [info.next_fire]
    assert backend.entry_definitions().keys() == {"far"}


def test_rrule_and_run_now(app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]]) -> None:
    # Both slots fire only if the leader plans the entry before its first one: a plan made after it
    # starts at the next slot. Three seconds ahead leave room for a save and a tick on a loaded machine
    # (one second ahead left as little as a few milliseconds, and a run at load 14 missed it).
    start = datetime.fromtimestamp(int(time.time()) + 3, UTC)
    save_entry("rr", "t.entries_noop", dateutil_rrule(SECONDLY, interval=2, dtstart=start, count=2), app=app)
    _tick_until(leader, lambda: len(_fired(sent, "rr")) >= 2)
    assert _fired(sent, "rr") == [start.timestamp(), start.timestamp() + 2]

    slot = run_now("cfg", app=app)
    _tick_until(leader, lambda: run_now_fired("cfg", slot, app=app))
    assert _fired(sent, "cfg").count(slot.timestamp()) == 1  # besides its own first slot
    for _ in range(5):
        leader.tick()
    assert _fired(sent, "cfg").count(slot.timestamp()) == 1
    with pytest.raises(ScheduleError, match="no beat entry"):
        run_now("missing", app=app)


def test_a_broken_definition_written_by_hand_disables_only_that_entry(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], backend: BeatBackend
) -> None:
    # written by hand: the backend's own upsert (the save_entry script, a row), no validation
    backend.entry_save("bad", '{"task": "t.entries_noop", "schedule": {"type": "weekly"}}')
    save_entry("good", "t.entries_noop", 1, app=app)
    _tick_until(leader, lambda: _fired(sent, "good"))
    assert "bad" in leader.broken
    assert "unknown schedule type" in leader.broken["bad"]
    assert _fired(sent, "bad") == []


def test_change_takes_effect_within_one_tick_with_many_entries(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bulk = crontab(minute=0, hour=3)
    save_entries([{"name": f"bulk-{i}", "task": "t.entries_noop", "schedule": bulk} for i in range(300)], app=app)
    term = leader.keeper.epoch
    leader.tick()
    assert len(leader.plans) == 301
    save_entry("late", "t.entries_noop", timedelta(seconds=30), app=app)
    # the tick reads the changed entry alone, not the whole set (its time is a benchmark's matter)
    reads: list[tuple[str, Any]] = []
    for method in ("read_all", "snapshot", "scan_definitions", "entry_definitions", "read_changed"):
        original = getattr(leader.backend, method)

        def spy(*args: Any, _name: str = method, _original: Any = original, **kwargs: Any) -> Any:
            reads.append((_name, args[0] if args else None))
            return _original(*args, **kwargs)

        monkeypatch.setattr(leader.backend, method, spy)
    leader.tick()
    monkeypatch.undo()
    assert leader.keeper.epoch == term  # one term: a new one would re-plan every entry, rightly
    assert reads == [("read_changed", ["late"])]
    # applied by that one tick: planned and in the due set, its first slot at most a second away
    assert "late" in leader.plans
    info = get_entry("late", app=app)
    assert info is not None
    assert info.next_fire is not None
    assert info.next_fire.timestamp() <= time.time() + 1.0
    _tick_until(leader, lambda: _fired(sent, "late"), timeout=3)


def test_invalid_policies_fail_inside_save_entry_naming_the_entry_and_option(app: Celery, backend: BeatBackend) -> None:
    with pytest.raises(ScheduleError, match="entry 'x': safe_time_jitter must be at least 0 seconds"):
        save_entry("x", "reports.send", 60, jitter=-1, app=app)
    with pytest.raises(ScheduleError, match="entry 'x': safe_time_jitter must be a number of seconds or a timedelta"):
        save_entry("x", "reports.send", 60, options={"safe_time_jitter": "30s"}, app=app)
    with pytest.raises(ScheduleError, match=r"entry 'x': safe_time_jitter \(60 s\) must be shorter than its interval"):
        save_entry("x", "reports.send", 60, jitter=timedelta(minutes=1), app=app)
    with pytest.raises(ScheduleError, match="entry 'x': safe_time_catchup_window must be above 0 seconds"):
        save_entry("x", "reports.send", 60, catchup_window=0, app=app)
    with pytest.raises(ScheduleError, match="entry 'x': jitter is given twice"):
        save_entry("x", "reports.send", 60, jitter=5, options={"safe_time_jitter": 5}, app=app)
    assert backend.entry_definitions() == {}


def test_a_jittered_runtime_entry_keeps_its_slot_and_publishes_at_its_offset(
    app: Celery, leader: SafeScheduler, sent: list[dict[str, Any]], backend: BeatBackend
) -> None:
    from celery_safe_time.beat.policies import jitter_offset

    info = save_entry(
        "jit", "t.entries_noop", 4, jitter=timedelta(seconds=3), catchup_window=timedelta(hours=1), app=app
    )
    assert info.options == {"safe_time_jitter": 3.0, "safe_time_catchup_window": 3600.0}  # stored as seconds
    published: list[float] = []

    def on_sent(sender: Any, entry: str, **kw: Any) -> None:
        if entry == "jit":
            published.append(leader.clock.time())

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    try:
        _tick_until(leader, lambda: len(_fired(sent, "jit")) >= 3, timeout=20)
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
    slots = _fired(sent, "jit")[:3]
    assert [b - a for a, b in itertools.pairwise(slots)] == [4.0, 4.0]  # the grid is not moved by the jitter
    for slot, at in zip(slots, published, strict=False):
        offset = jitter_offset("jit", slot, 3.0)
        assert slot + offset <= at < slot + offset + 1.0  # ticks every 0.05 s here; a loaded host is slower
    # get_entry's next_fire is the slot; the due score is that slot plus its offset
    _, score = _scheduled(backend, "jit")
    nxt = get_entry("jit", app=app)
    assert nxt is not None
    assert nxt.next_fire is not None
    assert score == nxt.next_fire.timestamp() + jitter_offset("jit", nxt.next_fire.timestamp(), 3.0)
    # the jitter removed: the same slot, due at its instant
    save_entry("jit", "t.entries_noop", 4, catchup_window=3600, app=app)
    leader.tick()
    assert _scheduled(backend, "jit")[1] == nxt.next_fire.timestamp()


def test_an_entry_resumed_while_no_beat_leads_fires_at_its_next_slot_only(
    app: Celery, tmp_path: Path, sent: list[dict[str, Any]]
) -> None:
    save_entry("r", "t.entries_noop", 2, app=app)
    first = SafeScheduler(app=app, schedule_filename=str(tmp_path / "1"), max_interval=1)
    try:
        wait_for(lambda: first.keeper.is_leader, 10)
        _tick_until(first, lambda: _fired(sent, "r"))
        set_enabled("r", False, app=app)
        first.tick()
    finally:
        first.close()
    last = _fired(sent, "r")[-1]
    time.sleep(max(0.0, last + 5 - time.time()))  # two slots fall while it is paused
    resumed_at = time.time()
    set_enabled("r", True, app=app)  # no beat runs: the next leader applies it when it takes the lease
    second = SafeScheduler(app=app, schedule_filename=str(tmp_path / "2"), max_interval=1)
    try:
        wait_for(lambda: second.keeper.is_leader, 10)
        _tick_until(second, lambda: _fired(sent, "r")[-1] > last)
    finally:
        second.close()
    after = [s for s in _fired(sent, "r") if s > last]
    assert len(after) == 1
    assert after[0] > resumed_at  # not a catch-up of a slot that fell during the pause
    assert (after[0] - last) % 2 == 0  # the same grid


def test_a_pause_that_expired_while_no_beat_led_is_resumed_by_the_next_leader(
    app: Celery, tmp_path: Path, sent: list[dict[str, Any]]
) -> None:
    from celery_safe_time.beat.entries import pause

    save_entry("p", "t.entries_noop", 2, app=app)
    info = pause("p", note="maintenance", until=timedelta(seconds=2), app=app)
    assert info is not None
    assert (info.enabled, info.pause_note, info.next_fire) == (False, "maintenance", None)
    assert info.paused_until is not None
    assert [e.pause_note for e in list_entries(app=app)] == [None, "maintenance"]  # cfg, p
    time.sleep(max(0.0, info.paused_until.timestamp() + 0.5 - time.time()))
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10)
        _tick_until(sched, lambda: _fired(sent, "p"))
    finally:
        sched.close()
    assert _fired(sent, "p")[0] > info.paused_until.timestamp()
    resumed = get_entry("p", app=app)
    assert resumed is not None
    assert (resumed.enabled, resumed.pause_note, resumed.paused_until) == (True, None, None)
    with pytest.raises(ScheduleError, match="entry 'p': pause note must be text"):
        pause("p", note=42, app=app)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"entry 'p': pause until .* is not in the future"):
        pause("p", until=timedelta(seconds=-1), app=app)
