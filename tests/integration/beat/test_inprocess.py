"""``SafeScheduler`` driven tick by tick in this process, on each beat backend (``coordination``:
Redis, PostgreSQL): signals, state, edits."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_safe_time import constants as C
from celery_safe_time import signals
from celery_safe_time.beat.scheduler import SafeScheduler
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration


def _noop() -> None:
    return None


def _scheduler(make_app: Any, tmp_path: Path, every: float, coordination: dict[str, Any]) -> SafeScheduler:
    app = make_app(safe_time_beat_lease=3, beat_schedule={"e": {"task": "t.noop", "schedule": every}}, **coordination)
    app.task(name="t.noop")(_noop)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
    return sched


def _state(sched: SafeScheduler) -> dict[str, Any]:
    raw = sched.backend.read_states(["e"])[0][0]
    return json.loads(raw or b"{}")  # type: ignore[no-any-return]


def test_dispatch_signal_state_and_schedule_edit(make_app: Any, tmp_path: Path, coordination: dict[str, Any]) -> None:
    sent: list[dict[str, Any]] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        sent.append(kw)

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    try:
        sched = _scheduler(make_app, tmp_path, 2.0, coordination)
        try:
            wait_for(lambda: (sched.tick(), sent)[1], 10, message="a dispatched slot")
        finally:
            sched.close()
        first = sent[0]
        assert first["entry"] == "e"
        assert first["epoch"] == 1
        assert first["slot"].timestamp() == int(first["slot"].timestamp())
        assert first["task_id"]
        state = _state(sched)
        assert state["last"] == first["slot"].timestamp()
        assert state["next"] == state["last"] + 2
        assert sched.backend.lease_view().ttl_ms is None  # released on close

        # an edit: the new grid continues from the last fired slot, not from "now"
        sched = _scheduler(make_app, tmp_path, 5.0, coordination)
        try:
            sched.tick()
            state = _state(sched)
            assert state["next"] == first["slot"].timestamp() + 5
            assert state["sig"] == "every 5s"
            assert "leader (epoch 2)" in sched.info
        finally:
            sched.close()
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)


def test_standby_does_not_tick_entries(make_app: Any, tmp_path: Path, coordination: dict[str, Any]) -> None:
    leader = _scheduler(make_app, tmp_path, 1.0, coordination)
    try:
        app = make_app(safe_time_beat_lease=3, beat_schedule={"e": {"task": "t.noop", "schedule": 1.0}}, **coordination)
        app.task(name="t.noop")(_noop)
        standby = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s2"), max_interval=1)
        try:
            assert not standby.keeper.is_leader
            # a standby only reads its lease thread's state: it looks again soon, to lead soon after a takeover
            assert standby.tick() == C.BEAT_STANDBY_WAKE
            assert "standby" in standby.info
            time.sleep(0.1)
        finally:
            standby.close()
        assert leader.backend.holds_lease(leader.lease.token)
    finally:
        leader.close()


def test_slots_due_together_go_out_in_one_batch_with_headers_and_signals(
    make_app: Any, tmp_path: Path, redis_client: redis.Redis
) -> None:
    from celery.signals import before_task_publish

    names = [f"e{i}" for i in range(5)]
    app = make_app(
        safe_time_beat_lease=3,
        beat_schedule={name: {"task": "t.noop", "schedule": 2.0, "options": {"queue": "q"}} for name in names},
    )
    app.task(name="t.noop")(_noop)
    dispatched: list[str] = []
    published: list[dict[str, Any]] = []

    def on_dispatched(sender: Any, **kw: Any) -> None:
        dispatched.append(kw["entry"])

    def on_publish(sender: Any = None, headers: Any = None, routing_key: Any = None, **kw: Any) -> None:
        published.append({"headers": dict(headers or {}), "routing_key": routing_key})

    signals.beat_slot_dispatched.connect(on_dispatched, weak=False)
    before_task_publish.connect(on_publish, weak=False)
    try:
        sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
        try:
            wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
            wait_for(lambda: (sched.tick(), len(dispatched) >= 5)[1], 10, message="five dispatched slots")
        finally:
            sched.close()
    finally:
        signals.beat_slot_dispatched.disconnect(on_dispatched)
        before_task_publish.disconnect(on_publish)
    first = sorted(dispatched[:5])
    assert first == names
    assert len(published) >= 5
    assert all(p["routing_key"] == "q" and "safe_time_slot" in p["headers"] for p in published[:5])
    # the five messages are in the queue, and their slot instants are one
    slots = {p["headers"]["safe_time_slot"] for p in published[:5]}
    assert len(slots) == 1
    assert redis_client.llen("q") >= 5


def test_slots_the_broker_refuses_are_each_recorded_not_published_and_free_their_overlap_markers(
    make_app: Any, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Three entries under an overlap policy due together, their batch's publishes refused by the
    broker (a Redis of this test's own at its memory limit). Each slot is logged and recorded as not
    published, once, and the queued marker each publish took (in the coordination Redis) goes back,
    so the next slot is not dropped as if a run were waiting."""
    from celery_safe_time import entry_history
    from celery_safe_time.locks.backends import get_lock_backend
    from celery_safe_time.locks.entry_runs import entry_key
    from tests.helpers.services import start_throwaway_redis

    broker = start_throwaway_redis()
    try:
        names = [f"e{i}" for i in range(3)]
        schedule = {n: {"task": "t.noop", "schedule": 2.0, "overlap": "skip"} for n in names}
        app = make_app(
            broker_url=broker.url, safe_time_redis_url=redis_url, safe_time_beat_lease=3, beat_schedule=schedule
        )
        app.task(name="t.noop")(_noop)
        redis.Redis.from_url(broker.url).config_set("maxmemory", 1)
        sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
        try:
            wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
            wait_for(lambda: (sched.tick(), all(entry_history(n, app=app) for n in names))[1], 10, message="records")
        finally:
            sched.close()
        markers = get_lock_backend(app)
        for name in names:
            records = entry_history(name, app=app)
            assert [r.outcome for r in records] == [C.RUN_NOT_PUBLISHED]
            assert markers.unique_info(entry_key(name), time.time()) is None
        assert len(re.findall(r"beat: entry 'e\d' slot \S+ not published: .*maxmemory", caplog.text)) == 3
        assert redis.Redis.from_url(broker.url).dbsize() == 0
    finally:
        broker.stop()
