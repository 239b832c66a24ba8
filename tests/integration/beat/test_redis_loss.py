"""A running in-process ``SafeScheduler`` whose Redis state goes away under it (real Redis): the due
set or the state hash evicted/deleted while the lease survives, and a FLUSHDB after which the
new lease has the same epoch number as the old one."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_safe_time import signals
from celery_safe_time.beat.scheduler import SafeScheduler
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

DUE = "safe_time:beat:due"
STATE = "safe_time:beat:state"


def _noop() -> None:
    return None


class Recorder:
    """What the scheduler signalled: dispatched (entry, slot) pairs, duplicates refused, leases taken."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, float, float]] = []  # (entry, slot, time.time() when sent)
        self.duplicates: list[tuple[str, float]] = []
        self.acquired: list[int] = []

    def on_sent(self, sender: Any, **kw: Any) -> None:
        self.sent.append((kw["entry"], kw["slot"].timestamp(), time.time()))

    def on_duplicate(self, sender: Any, **kw: Any) -> None:
        self.duplicates.append((kw["entry"], kw["slot"].timestamp()))

    def on_acquired(self, sender: Any, **kw: Any) -> None:
        self.acquired.append(kw["epoch"])

    def slots(self, entry: str, after: float = 0.0) -> list[float]:
        return [slot for name, slot, at in self.sent if name == entry and at > after]

    def twice(self) -> dict[tuple[str, float], int]:
        count = collections.Counter((name, slot) for name, slot, _ in self.sent)
        return {key: n for key, n in count.items() if n > 1}


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    pairs = [
        (signals.beat_slot_dispatched, rec.on_sent),
        (signals.beat_slot_duplicate, rec.on_duplicate),
        (signals.beat_lease_acquired, rec.on_acquired),
    ]
    for signal, receiver in pairs:
        signal.connect(receiver, weak=False)
    yield rec
    for signal, receiver in pairs:
        signal.disconnect(receiver)


def run_ticks(sched: Any, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(max(float(sched.tick()), 0.01), 0.2))


@pytest.fixture
def scheduler(make_app: Any, tmp_path: Path, recorder: Recorder) -> Iterator[SafeScheduler]:
    # recorder first: it sees the lease taken in the constructor
    schedule = {name: {"task": "t.noop_loss", "schedule": 1.0} for name in ("a", "b")}
    app = make_app(safe_time_beat_lease=3, beat_schedule=schedule)
    app.task(name="t.noop_loss")(_noop)
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        yield sched
    finally:
        sched.close()


def assert_on_grid(slots: list[float]) -> None:
    assert slots
    assert [b - a for a, b in itertools.pairwise(slots)] == [1.0] * (len(slots) - 1), slots


@pytest.mark.parametrize("key", [DUE, STATE])
def test_deleted_state_key_under_a_running_leader_keeps_it_firing(
    scheduler: SafeScheduler,
    recorder: Recorder,
    redis_client: redis.Redis,
    key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_ticks(scheduler, 2.5)
    assert recorder.slots("a")
    assert recorder.slots("b")
    epoch = scheduler.keeper.epoch
    with caplog.at_level("WARNING"):
        assert redis_client.delete(key) == 1  # evicted (allkeys-lru) or deleted by hand; the lease stays
        deleted_at = time.time()
        run_ticks(scheduler, 3.5)
    assert scheduler.keeper.epoch == epoch  # the same lease all along
    for entry in ("a", "b"):
        # firing resumes within a tick or two, on the same grid, nothing skipped
        after = recorder.slots(entry, after=deleted_at)
        assert after, entry
        assert after[0] <= deleted_at + 2.0, (entry, deleted_at, after)
        assert_on_grid(recorder.slots(entry))
    assert recorder.twice() == {}
    assert recorder.duplicates == []
    if key == DUE:
        assert "reconciling" in caplog.text


def test_flushdb_then_a_new_lease_with_the_same_epoch_reconciles(
    scheduler: SafeScheduler, recorder: Recorder, redis_client: redis.Redis
) -> None:
    run_ticks(scheduler, 2.0)
    assert recorder.acquired == [1]
    before = scheduler.keeper.term
    redis_client.flushdb()  # a Redis restarted without persistence: epochs start again at 1
    # no tick meanwhile: the lease thread loses the lease and takes a new one, epoch 1 again
    wait_for(lambda: len(recorder.acquired) == 2, 10, message="a new lease")
    assert recorder.acquired == [1, 1]
    after = scheduler.keeper.term
    assert before is not None
    assert after is not None
    assert after.epoch == before.epoch
    assert after != before  # a new term: what the scheduler keys its reconcile on
    taken_at = time.time()
    run_ticks(scheduler, 3.0)
    for entry in ("a", "b"):
        assert recorder.slots(entry, after=taken_at), f"{entry} stopped firing after the Redis reset"
    assert recorder.twice() == {}
