"""Overlap policies: the pure decision, the definition checks, and beat's gate on the in-memory lock
backend with the time injected (the queued marker and the run lease as the worker leaves them), and
``SafeScheduler`` dropping the slots of a ``skip`` entry while its run is queued."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_safe_time import constants as C
from celery_safe_time.beat.backends.memory import MemoryBeatData
from celery_safe_time.beat.overlap import OverlapGate, decide, overlap_of
from celery_safe_time.beat.policies import (
    OPTION_OVERLAP,
    OPTION_OVERLAP_TTL,
    beat_slot_dropped,
    config_spec,
    policy_options,
)
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ScheduleError
from celery_safe_time.locks.backends import Owner, use_lock_backend
from celery_safe_time.locks.backends.memory import MemoryLockBackend
from celery_safe_time.locks.entry_runs import entry_key, overlap_spec, run_key
from celery_safe_time.metrics import disable_metrics, enable_metrics
from tests.unit.beat.conftest import T0, FakeTime, memory_app


# --- the decision ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "running", "queued", "verdict"),
    [
        ("allow", True, True, "publish"),
        ("skip", False, False, "publish"),
        ("skip", True, False, "drop"),
        ("skip", False, True, "drop"),
        ("buffer_one", False, False, "publish"),
        ("buffer_one", True, False, "publish"),
        ("buffer_one", True, True, "drop"),
        ("buffer_one", False, True, "drop"),
        ("buffer_all", True, True, "publish"),
        ("cancel_other", False, False, "publish"),
        ("cancel_other", True, False, "cancel"),
        ("cancel_other", False, True, "cancel"),
    ],
)
def test_decide(policy: str, running: bool, queued: bool, verdict: str) -> None:
    assert decide(policy, running=running, queued=queued) == verdict


# --- definition -----------------------------------------------------------------------------------
def test_a_bad_policy_names_the_entry_and_the_allowed_values() -> None:
    with pytest.raises(ScheduleError, match=r"entry 'nightly': safe_time_overlap must be one of allow, skip, "):
        policy_options("nightly", None, overlap="sometimes")
    with pytest.raises(ScheduleError, match=r"entry 'nightly'.*buffer_one.*'never'"):
        policy_options("nightly", {"safe_time_overlap": "never"})
    with pytest.raises(ScheduleError, match="entry 'nightly': safe_time_overlap_ttl must be above 0"):
        policy_options("nightly", None, overlap="skip", overlap_ttl=0)


def test_the_keyword_the_alias_and_the_option_spell_the_same_policy() -> None:
    expected = {OPTION_OVERLAP: "skip", "queue": "q"}
    assert policy_options("e", {"queue": "q"}, overlap="skip") == expected
    assert policy_options("e", {"queue": "q", "overlap": "skip"}) == expected  # the alias never reaches apply_async
    assert policy_options("e", {"queue": "q", OPTION_OVERLAP: "skip"}) == expected
    assert policy_options("e", None, overlap_ttl=dt.timedelta(seconds=30)) == {OPTION_OVERLAP_TTL: 30.0}
    spec = config_spec("e", {"task": "t", "schedule": 10, "overlap": "buffer_one", "options": {"queue": "q"}})
    assert spec["options"] == {OPTION_OVERLAP: "buffer_one", "queue": "q"}
    assert "overlap" not in spec
    assert config_spec("e", {"task": "t", "options": {"overlap": "skip"}})["options"] == {OPTION_OVERLAP: "skip"}
    with pytest.raises(ScheduleError, match="given twice"):
        policy_options("e", {"overlap": "skip"}, overlap="skip")
    with pytest.raises(ScheduleError, match="given twice"):
        policy_options("e", {"overlap": "skip", OPTION_OVERLAP: "skip"})
    with pytest.raises(ScheduleError, match="entry 'e'"):
        config_spec("e", {"task": "t", "options": {"overlap": "maybe"}})


def test_the_ttl_defaults_to_the_lock_ttl() -> None:
    config = get_config(_app())
    assert overlap_of({}, "e", config).policy == "allow"
    assert overlap_of({OPTION_OVERLAP: "skip"}, "e", config).ttl == config.lock_ttl
    assert overlap_of({OPTION_OVERLAP: "skip", OPTION_OVERLAP_TTL: 5}, "e", config).ttl == 5.0


def test_the_worker_reads_only_a_well_formed_header() -> None:
    class Request:
        def __init__(self, value: Any) -> None:
            self.headers = {C.HEADER_OVERLAP: value}

    good = overlap_spec(Request({"entry": "e", "policy": "buffer_all", "ttl": 5, "after": "t0"}))
    assert good is not None
    assert (good.entry, good.policy, good.ttl, good.after) == ("e", "buffer_all", 5.0, "t0")
    assert good.marker("t1") == run_key("e", "t1")
    skip = overlap_spec(Request({"entry": "e", "policy": "skip", "ttl": 5}))
    assert skip is not None
    assert skip.marker("t1") == entry_key("e")
    for bad in (None, "skip", {"entry": "e", "policy": "allow", "ttl": 5}, {"entry": "e", "policy": "x", "ttl": 5},
                {"entry": "e", "policy": "skip", "ttl": 0}, {"entry": "e", "policy": "skip", "ttl": "5"}):  # fmt: skip
        assert overlap_spec(Request(bad)) is None, bad


# --- beat's gate on the memory backend, time injected --------------------------------------------------
def _app() -> Celery:
    return memory_app("overlap-unit")


@pytest.fixture
def gate(clock: FakeTime) -> Iterator[tuple[OverlapGate, MemoryLockBackend]]:
    app = _app()
    store = MemoryLockBackend(get_config(app), clock=clock)
    use_lock_backend(app, store)
    yield OverlapGate(app, get_config(app)), store
    use_lock_backend(app, None)


def _start(store: MemoryLockBackend, entry: str, task_id: str, ttl: float) -> str:
    """What a worker does when the run starts: take the lease, drop the queued marker."""
    token = f"token-{task_id}"
    got = store.acquire(entry_key(entry), token, ttl, Owner(task_id, f"{task_id}:0:0", "host", 1))
    assert got.status == "acquired"
    store.unique_release(entry_key(entry), task_id)
    return token


def _task_id(extra: dict[str, Any] | None) -> str:
    assert extra is not None
    return str(extra["task_id"])


def test_skip_drops_while_a_run_is_queued_or_running_and_the_lease_expires(
    gate: tuple[OverlapGate, MemoryLockBackend], clock: FakeTime
) -> None:
    beat, store = gate
    options = {OPTION_OVERLAP: "skip", OPTION_OVERLAP_TTL: 10}
    dropped: list[tuple[str, str]] = []

    def on_dropped(sender: Any, entry: str, policy: str, reason: str, **_: Any) -> None:
        dropped.append((policy, reason))

    beat_slot_dropped.connect(on_dropped, weak=False)
    try:
        first = beat.admit("e", options, T0)
        assert first is not None
        assert first["headers"][C.HEADER_OVERLAP] == {"entry": "e", "policy": "skip", "ttl": 10.0}
        assert beat.admit("e", options, T0 + 1) is None  # queued
        token = _start(store, "e", _task_id(first), 10)
        clock.now += 5
        assert beat.admit("e", options, T0 + 5) is None  # running
        store.release(entry_key("e"), token)
        assert beat.admit("e", options, T0 + 6) is not None  # ended: the next slot runs
        # a queued run whose message was lost stops counting after ttl + its re-check
        clock.now += 11.5
        killed = beat.admit("e", options, T0 + 18)
        assert killed is not None
        _start(store, "e", _task_id(killed), 10)  # and then its worker is killed: the lease is never renewed
        clock.now += 9.9
        assert beat.admit("e", options, T0 + 28) is None
        clock.now += 0.2
        assert beat.admit("e", options, T0 + 29) is not None  # freed within the ttl
    finally:
        beat_slot_dropped.disconnect(on_dropped)
    assert dropped == [("skip", "queued"), ("skip", "running"), ("skip", "running")]


def test_buffer_one_publishes_behind_a_running_run_and_drops_while_one_waits(
    gate: tuple[OverlapGate, MemoryLockBackend],
) -> None:
    beat, store = gate
    options = {OPTION_OVERLAP: "buffer_one", OPTION_OVERLAP_TTL: 10}
    first = beat.admit("e", options, T0)
    _start(store, "e", _task_id(first), 10)
    waiting = beat.admit("e", options, T0 + 1)
    assert waiting is not None  # one waits behind the running run
    assert beat.admit("e", options, T0 + 2) is None
    assert beat.admit("e", options, T0 + 3) is None
    info = store.unique_info(entry_key("e"), T0)
    assert info is not None
    assert info.task_id == _task_id(waiting)


def test_buffer_all_chains_each_run_behind_the_one_before(gate: tuple[OverlapGate, MemoryLockBackend]) -> None:
    beat, store = gate
    options = {OPTION_OVERLAP: "buffer_all", OPTION_OVERLAP_TTL: 10}
    ids = []
    afters = []
    for k in range(3):
        extra = beat.admit("e", options, T0 + k)
        ids.append(_task_id(extra))
        assert extra is not None
        afters.append(extra["headers"][C.HEADER_OVERLAP].get("after"))
    assert afters == [None, ids[0], ids[1]]
    assert all(store.unique_info(run_key("e", t), T0) is not None for t in ids)


def test_cancel_other_revokes_the_running_and_the_queued_run(
    gate: tuple[OverlapGate, MemoryLockBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    beat, store = gate
    revoked: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(beat.app.control, "revoke", lambda task_id, **kw: revoked.append((task_id, kw)))
    options = {OPTION_OVERLAP: "cancel_other", OPTION_OVERLAP_TTL: 10}
    first = _task_id(beat.admit("e", options, T0))
    assert revoked == []
    _start(store, "e", first, 10)
    second = _task_id(beat.admit("e", options, T0 + 1))
    assert revoked == [(first, {"terminate": True, "signal": "SIGTERM"})]
    third = _task_id(beat.admit("e", options, T0 + 2))  # the second still waits for the lease: revoked too
    assert revoked[1:] == [(second, {}), (first, {"terminate": True, "signal": "SIGTERM"})]
    info = store.unique_info(entry_key("e"), T0)
    assert info is not None
    assert info.task_id == third


def _noop() -> None:
    return None


# --- SafeScheduler ----------------------------------------------------------------------------------------
def test_the_scheduler_drops_the_slots_of_a_skip_entry_while_its_run_is_queued(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app()
    app.conf.beat_schedule = {
        "often": {"task": "t.overlap_noop", "schedule": 10.0, "overlap": "skip", "overlap_ttl": 25},
        "plain": {"task": "t.overlap_noop", "schedule": 10.0},
    }
    app.task(name="t.overlap_noop", shared=False)(_noop)
    use_lock_backend(app, MemoryLockBackend(get_config(app), clock=clock))
    registry = CollectorRegistry()
    enable_metrics(registry)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    sched.keeper._stop.set()
    sent: list[str] = []
    monkeypatch.setattr(sched, "_sent", lambda entry, slot, epoch, result: sent.append(entry.name))
    try:
        while clock.now < T0 + 45:
            if clock.now % 5 == 0:  # renew the lease by hand, on the injected clock
                sched.keeper._stop.clear()
                assert sched.keeper._attempt()
                sched.keeper._stop.set()
            sched.tick()
            clock.now += 0.5
    finally:
        sched.close()
        disable_metrics()
        use_lock_backend(app, None)
    # never started (no worker): the first run stays queued for 25 s + its re-check, then the next slot goes
    assert sent.count("plain") == 5
    assert sent.count("often") == 2
    assert registry.get_sample_value("safe_time_beat_slots_dropped_total", {"entry": "often"}) == 3


def test_a_slot_that_could_not_be_published_frees_its_marker(gate: tuple[OverlapGate, MemoryLockBackend]) -> None:
    beat, store = gate
    options = {OPTION_OVERLAP: "skip", OPTION_OVERLAP_TTL: 10}
    extra = beat.admit("e", options, T0)
    assert extra is not None
    beat.unpublished("e", extra)
    assert store.unique_info(entry_key("e"), T0) is None
    assert beat.admit("e", options, T0 + 1) is not None


def test_the_worker_wrapper_keeps_run_as_it_was_for_the_lock_decorators() -> None:
    import inspect

    from celery_safe_time import overlap_lock
    from celery_safe_time.locks.entry_runs import install_worker
    from celery_safe_time.locks.hard_limit import locks_of

    app = _app()

    @app.task(bind=True, name="t.bound", shared=False)
    @overlap_lock("bound:{x}")
    def bound(self: Any, x: int) -> int:
        return x + 1

    @app.task(name="t.plain", shared=False)
    def plain(x: int) -> int:
        return x * 2

    locks = locks_of(app.tasks["t.bound"])
    install_worker(app)
    install_worker(app)  # idempotent: wrapped once
    assert inspect.ismethod(app.tasks["t.bound"].run)
    assert locks_of(app.tasks["t.bound"]) == locks
    assert len(locks) == 1
    assert app.tasks["t.plain"].run(3) == 6  # no header: straight through
