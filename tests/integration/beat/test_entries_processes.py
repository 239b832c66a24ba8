"""Runtime entries with real ``celery beat`` processes: add, change, pause and remove entries while three
beats run and the leader is killed."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import delete_entry, save_entry
from celery_safe_time.beat.entries import set_enabled
from tests.helpers.beat import BEAT_APP, beat_env, duplicates, leader_pid, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

LEASE = 6.0
DUE = "safe_time:beat:due"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _slots(client: redis.Redis, label: str) -> list[float]:
    return sorted(datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in runs(client, label))


def _settle(client: redis.Redis) -> None:
    last = -1
    while (now := len(runs(client))) != last:
        last = now
        time.sleep(1.5)


def _applied(client: redis.Redis, predicate: Callable[[], bool]) -> float:
    """Wait until the leader applied a change (seen in its Redis state); returns when that was."""
    wait_for(predicate, 10, interval=0.05, message="the leader to apply the change")
    return time.time()


def test_add_change_pause_remove_while_three_beats_run_and_the_leader_dies(
    processes: ProcessManager, redis_client: redis.Redis, make_app: Callable[..., Celery]
) -> None:
    app = make_app()
    app.task(name="tests.record", shared=False)(_noop)  # the name the beats' app registers
    env = beat_env({}, safe_time_beat_lease=LEASE)
    processes.worker(BEAT_APP, env=env, name="worker")
    beats = [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(3)]
    pid = wait_for(lambda: leader_pid(redis_client), 30, message="a leader")
    leader = next(b for b in beats if b.pid == pid)

    def save(name: str, every: float, **kw: Any) -> None:
        save_entry(name, "tests.record", every, args=(name,), app=app, **kw)

    # added at runtime: every beat is already running
    skip: dict[str, Any] = {"options": {"safe_time_misfire": "skip"}}
    for name in ("keep", "chg", "rm"):
        save(name, 1)
    save("pz", 1, **skip)
    wait_for(
        lambda: all(len(runs(redis_client, n)) >= 2 for n in ("keep", "chg", "rm", "pz")), 20, message="first runs"
    )

    save("chg", 2)
    set_enabled("pz", False, app=app)
    assert delete_entry("rm", app=app)
    effective = _applied(
        redis_client, lambda: redis_client.zscore(DUE, "pz") is None and not redis_client.zscore(DUE, "rm")
    )
    time.sleep(2)

    leader.kill()
    killed = time.time()
    epochs_before = {r["headers"]["safe_time_epoch"] for r in runs(redis_client)}
    wait_for(
        lambda: any(r["headers"]["safe_time_epoch"] not in epochs_before for r in runs(redis_client, "keep")),
        LEASE + LEASE / 3 + 10,
        message="the new leader firing the runtime entry",
    )
    assert time.time() - killed <= LEASE + LEASE / 3 + 5

    resumed = time.time()
    set_enabled("pz", True, app=app)
    wait_for(lambda: any(s >= resumed for s in _slots(redis_client, "pz")), 10, message="pz after the resume")
    time.sleep(2)
    # The standbys stop before the leader: a leader stopping first hands its lease to a standby, whose
    # new epoch may fire a slot before its own SIGTERM lands (three epochs where the test made two).
    current = leader_pid(redis_client)
    for beat in sorted(beats, key=lambda b: b.pid == current):
        beat.terminate()
    _settle(redis_client)

    assert duplicates(redis_client) == {}, "a slot fired twice"
    # removed: no slot after the change took effect (a slot due at that very tick may still go out)
    assert [s for s in _slots(redis_client, "rm") if s > effective] == []
    # paused (misfire skip): nothing between the pause taking effect and the resume
    assert [s for s in _slots(redis_client, "pz") if effective < s < resumed] == []
    assert any(s >= resumed for s in _slots(redis_client, "pz"))
    # changed to every 2 s: after the change, the slots keep a 2 s grid, across the failover too
    after = [s for s in _slots(redis_client, "chg") if s > effective]
    assert after, "the changed entry stopped firing"
    assert all((b - a) % 2 == 0 for a, b in itertools.pairwise(after))
    # the entry left alone fired under both leaders, on its 1 s grid
    keep = _slots(redis_client, "keep")
    assert all(b - a >= 1 for a, b in itertools.pairwise(keep))
    assert len({r["headers"]["safe_time_epoch"] for r in runs(redis_client, "keep")}) == 2
