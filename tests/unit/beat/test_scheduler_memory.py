"""``SafeScheduler`` on the in-memory beat backend, time injected: one leader of two, each slot once,
a take-over continues the grid, a stale leader is refused. No Redis, no database, no sleeping."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from celery.signals import before_task_publish

from celery_safe_time.beat import base as beat_base
from celery_safe_time.beat.backends.memory import MemoryBeatData
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.config import get_config
from tests.unit.beat.conftest import T0, FakeTime, OnDispatched, memory_app


@pytest.fixture
def sent(on_dispatched: OnDispatched) -> list[tuple[str, float, int]]:
    out: list[tuple[str, float, int]] = []

    def on_sent(sender: Any, entry: str, slot: Any, epoch: int, **kw: Any) -> None:
        out.append((entry, slot.timestamp(), epoch))

    on_dispatched(on_sent)
    return out


def _noop() -> None:
    return None


def _scheduler(tmp_path: Path, name: str, entries: tuple[str, ...] = ("e",)) -> SafeScheduler:
    schedule = {entry: {"task": "t.memory_beat_noop", "schedule": 1.0} for entry in entries}
    app = memory_app("memory-beat", beat_schedule=schedule)
    app.task(name="t.memory_beat_noop", shared=False)(_noop)
    get_config(app)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / name), max_interval=1)
    sched.keeper._stop.set()  # drive the lease by hand (``_attempt``), on the injected clock
    return sched


def _slots(sent: list[tuple[str, float, int]], epoch: int | None = None) -> list[float]:
    return [slot - T0 for _, slot, e in sent if epoch is None or e == epoch]


def test_one_leader_each_slot_once_and_a_takeover_continues_the_grid(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, int]]
) -> None:
    a = _scheduler(tmp_path, "a")
    b = _scheduler(tmp_path, "b")
    try:
        assert a.keeper.is_leader  # the first to start took the lease
        assert not b.keeper.is_leader
        for _ in range(3):
            a.tick()
            b.tick()
            clock.now += 1.0
        # a new entry's first slot is the next one of its grid after "now"; one publish per slot
        assert _slots(sent) == [1.0, 2.0]
        # a dies (no release); b takes over once the lease expired on the backend's clock
        clock.now += 30.0
        b.keeper._stop.clear()
        assert b.keeper._attempt()
        b.keeper._stop.set()
        assert b.keeper.epoch == 2
        b.tick()
        # the new leader goes on from where the old one stopped: the slots of the last lease are on
        # time (each published once), older ones follow the misfire policy; never one fired before
        late = _slots(sent, epoch=2)
        assert late[-1] == 33.0
        assert late[0] > 2.0
        assert all(y - x == 1.0 for x, y in itertools.pairwise(late))
        clock.now += 1.0
        b.tick()
        assert _slots(sent, epoch=2)[-1] == 34.0
        # the old leader wakes up and ticks first at the next slot: the guard refuses it (another beat
        # holds the lease), it stands down, nothing published; the leader then fires that slot
        clock.now += 1.0
        a.tick()
        assert not a.keeper.is_leader
        assert _slots(sent, epoch=1) == [1.0, 2.0]
        b.tick()
        assert _slots(sent, epoch=2)[-1] == 35.0
        assert len(set(_slots(sent))) == len(sent)
    finally:
        a.close()
        b.close()
    assert data.token is None  # b released the lease on close


def test_a_leader_that_loses_its_lease_before_its_first_reconcile_stands_by_and_keeps_running(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, int]]
) -> None:
    """A beat paused (SIGSTOP, GC, VM freeze) right after taking the lease wakes up to find another
    beat holding it: its plan write is refused and it stands by: nothing escapes ``tick`` (an error only the Redis
    backend's errors include would end the beat process on PostgreSQL, and here)."""
    a = _scheduler(tmp_path, "a")
    b = _scheduler(tmp_path, "b")
    try:
        assert a.keeper.is_leader  # took the lease at startup, has not ticked (reconciled) yet
        clock.now += 31.0  # a is paused past its lease; b takes it over
        b.keeper._stop.clear()
        assert b.keeper._attempt()
        b.keeper._stop.set()
        assert b.keeper.epoch == 2
        a.tick()  # wakes up: the reconcile's plan write is refused
        assert not a.keeper.is_leader
        assert sent == []
        b.tick()
        clock.now += 1.0
        b.tick()
        assert {epoch for _, _, epoch in sent} == {2}
        a.tick()  # a standby's tick: nothing, no error
        assert not a.keeper.is_leader
    finally:
        a.close()
        b.close()


def test_a_new_term_is_not_behind_on_the_change_log_of_an_earlier_one(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, int]]
) -> None:
    """A leader that lost its lease part-way through applying the change log a batch at a time keeps
    no "behind" from that term: its next term's reconcile reads the whole state, and a due name it
    does not know is dropped again (while behind, such a name is a save it has not applied yet)."""
    a = _scheduler(tmp_path, "a")
    b = _scheduler(tmp_path, "b")
    try:
        a.tick()
        a.changes_behind = True  # a batch of the log applied, more to read, when the lease goes
        clock.now += 31.0
        b.keeper._stop.clear()
        assert b.keeper._attempt()
        b.keeper._stop.set()
        a.tick()  # refused: stands by
        assert not a.keeper.is_leader
        b.close()
        clock.now += 31.0
        a.keeper._stop.clear()
        assert a.keeper._attempt()
        a.keeper._stop.set()
        a.tick()  # the new term's reconcile
        assert a.keeper.is_leader
        assert not a.changes_behind
        data.due["ghost"] = clock.now - 1.0  # a name no definition has
        a.tick()
        assert "ghost" not in data.due
    finally:
        a.close()
        b.close()


def test_a_backend_error_during_a_tick_stands_by_and_the_log_names_the_backend(
    tmp_path: Path, data: MemoryBeatData, caplog: pytest.LogCaptureFixture
) -> None:
    a = _scheduler(tmp_path, "a")
    try:
        assert a.keeper.is_leader
        with caplog.at_level("ERROR", logger="celery_safe_time.beat.base"):
            wait = a.backend_failed(ConnectionError("connection refused"))
        assert wait == a.granularity
        assert not a.keeper.is_leader
        assert "beat: memory error during tick, standing by: connection refused" in caplog.messages
    finally:
        a.close()


def test_a_stop_signal_while_publishing_waits_until_every_slot_marked_fired_is_sent(
    tmp_path: Path, clock: FakeTime, data: MemoryBeatData, sent: list[tuple[str, float, int]]
) -> None:
    """``celery beat`` stops on SIGTERM by raising SystemExit wherever it is. Arriving between the
    guard marking a tick's slots fired and their publish, that lost them on a plain restart (no beat
    sends a fired slot again); found by the Django failover test, whose count of runs came out above
    its runs. The signal is now acted on once the tick's slots are out."""
    a = _scheduler(tmp_path, "a", entries=("e1", "e2", "e3"))
    stops: list[int] = []

    def stop(signum: int, frame: Any) -> None:  # what celery.apps.beat installs
        stops.append(signum)
        raise SystemExit()

    def signal_on_first_publish(**kwargs: Any) -> None:
        if not stops and not kicked:
            kicked.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    kicked: list[bool] = []
    previous = signal.signal(signal.SIGTERM, stop)
    before_task_publish.connect(signal_on_first_publish, weak=False)
    try:
        a.tick()  # reconciles: the first slots are the next ones of each grid
        clock.now += 1.0
        with pytest.raises(SystemExit):
            a.tick()
        assert kicked
        assert stops == [signal.SIGTERM]
        assert sorted(name for name, _, _ in sent) == ["e1", "e2", "e3"]  # every fired slot went out
        with pytest.raises(SystemExit):  # between ticks beat's own handler runs at once
            os.kill(os.getpid(), signal.SIGTERM)
        assert stops == [signal.SIGTERM, signal.SIGTERM]
    finally:
        before_task_publish.disconnect(signal_on_first_publish)
        signal.signal(signal.SIGTERM, previous)
        a.close()


def test_stop_signals_held_acts_at_once_on_a_second_signal_and_holds_nothing_off_the_main_thread() -> None:
    received: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with beat_base.stop_signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert received == []  # held
            os.kill(os.getpid(), signal.SIGTERM)
            assert received == [signal.SIGTERM]  # a second one is not held: a stuck publish can be stopped
        assert received == [signal.SIGTERM]  # the held one is not acted on twice
        assert _acts_at_once(stop, received)
        received.clear()

        def off_main() -> None:
            with beat_base.stop_signals_held():  # signal.signal would raise off the main thread
                pass

        worker = threading.Thread(target=off_main)
        worker.start()
        worker.join()
        with beat_base.stop_signals_held():
            pass
        assert received == []  # nothing held, nothing acted on
    finally:
        signal.signal(signal.SIGTERM, previous)


def _acts_at_once(handler: Any, received: list[int]) -> bool:
    """Outside a block, SIGTERM reaches ``handler`` at once (the hold stays installed around it)."""
    before = len(received)
    os.kill(os.getpid(), signal.SIGTERM)
    reached = len(received) == before + 1
    del received[before:]
    return reached and getattr(signal.getsignal(signal.SIGTERM), "__wrapped__", None) is handler


def test_stop_signals_held_follows_a_handler_set_between_blocks_and_one_put_back() -> None:
    """Beat (or a test) may set its handler at any time: the next block holds for that one, and a
    handler put back afterwards (``signal.signal(sig, previous)``) still calls what it called."""
    first: list[int] = []
    second: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: first.append(signum))
    try:
        with beat_base.stop_signals_held():
            pass
        wrapped_first = signal.signal(signal.SIGTERM, lambda signum, frame: second.append(signum))
        with beat_base.stop_signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert second == []
        assert (first, second) == ([], [signal.SIGTERM])
        signal.signal(signal.SIGTERM, wrapped_first)
        os.kill(os.getpid(), signal.SIGTERM)
        assert (first, second) == ([signal.SIGTERM], [signal.SIGTERM])
        with beat_base.stop_signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert first == [signal.SIGTERM]  # held again: no second wrapper around the first
        assert first == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_signals_held_keeps_sigint_s_keyboard_interrupt_for_the_end_of_the_block() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached_end = interrupted = False
    try:
        try:
            with beat_base.stop_signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                reached_end = True
        except KeyboardInterrupt:
            interrupted = True
        assert reached_end
        assert interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("second", [False, True])
def test_stop_signals_held_with_the_default_action_terminates_at_block_end_and_leaves_it_in_place(
    second: bool,
) -> None:
    """SIGTERM's default action (no Python handler) is held for the block only: the process ends at
    the block's end (at once on a second signal), and between blocks nothing Python sits in front of
    it (a Python handler would wait for the main thread, which a stuck C call never gives back)."""
    code = f"""
import os, signal, sys
from celery_safe_time.beat.base import stop_signals_held
signal.signal(signal.SIGTERM, signal.SIG_DFL)
with stop_signals_held():
    pass
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
with stop_signals_held():
    os.kill(os.getpid(), signal.SIGTERM)
    print("held", flush=True)
    if {second}:
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
print("not reached", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == "held\n"
