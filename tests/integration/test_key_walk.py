"""Every Redis key the package writes in one scenario (beat, history, audit, delays, locks, limits,
unique, debounce; then real beat and worker processes) has a TTL or is on the documented list of
permanent keys (docs/operations.md, "Security"), on a plain Redis and on a Redis Cluster."""

from __future__ import annotations

import fnmatch
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import (
    SafeTask,
    delete_entry,
    entry_history,
    idempotent,
    overlap_lock,
    save_entry,
)
from celery_safe_time.beat.entries import pause, resume, run_now
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.beat.shards import shard_of
from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner, get_lock_backend
from celery_safe_time.locks.limits import slot_key
from celery_safe_time.locks.rates import Rate
from celery_safe_time.redis_client import create_redis
from tests.helpers.beat import BEAT_APP, beat_env, runs
from tests.helpers.processes import ProcessManager, wait_for
from tests.integration.test_cluster import topology_url

pytestmark = pytest.mark.integration

#: The keys that live without a TTL, as docs/operations.md lists them (after the prefix; on a cluster
#: ``beat`` is ``{beat}``): one each, or one per beat entry, each bounded in size.
PERMANENT = (
    "beat:epoch",
    "beat:state",
    "beat:due",
    "beat:entries",
    "beat:entries:version",
    "beat:entries:changed",
    "beat:entries:names",
    "beat:entries:names:version",
    "beat:entries:applied",
    "beat:entries:run-now",
    "beat:entries:paused-until",
    "beat:history:*",
    "beat:history-slots:*",
    "beat:audit:*",
    # sharded firing (safe_time_beat_shards): each shard's own, as shard 0's above
    "beat:shard:*:epoch",
    "beat:shard:*:state",
    "beat:shard:*:due",
    "beat:shard:*:entries:applied",
    "beat:shard:*:entries:paused-until",
)


def _noop(*_: Any, **__: Any) -> None:
    return None


@pytest.fixture(params=["single", "cluster"])
def topology(request: pytest.FixtureRequest, redis_url: str) -> str:
    return topology_url(request, redis_url, request.param)


def test_every_key_has_a_ttl_or_is_a_documented_permanent_key(
    make_app: Callable[..., Celery], topology: str, tmp_path: Path
) -> None:
    prefix = f"walk-{uuid.uuid4().hex[:8]}:"
    app = make_app(safe_time_redis_url=topology, safe_time_key_prefix=prefix, safe_time_beat_lease=6)
    app.task(name="walk.noop", shared=False)(_noop)

    # beat: runtime entries, a leader firing them (lease, epoch, state, due set, fired markers, run
    # history), pause/resume/run-now/delete (change audit, tombstones)
    save_entry("walk-every-second", "walk.noop", 1.0, app=app)
    save_entry("walk-hourly", "walk.noop", 3600.0, app=app, overlap="skip")
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        pause("walk-hourly", note="walk", app=app)
        resume("walk-hourly", app=app)
        run_now("walk-hourly", app=app)
        wait_for(lambda: (sched.tick(), len(entry_history("walk-every-second", app=app)) >= 2)[1], 20, interval=0.1)
        assert delete_entry("walk-hourly", app=app)
        sched.tick()
    finally:
        sched.close()

    # locks: overlap locks (high-cardinality keys), idempotent keys, slots, rates, unique keys
    @app.task(shared=False)
    @overlap_lock("sync:{account}", ttl=30)
    def sync(account: str) -> None: ...

    @app.task(shared=False)
    @idempotent("charge:{n}", window=600)
    def charge(n: int) -> int:
        return n

    for account in range(50):
        sync(f"acct:{account}")
    assert charge(1) == 1
    assert charge(1) is None
    backend = get_lock_backend(app)
    owner = Owner(task_id="w", identity="w:0:0", host="h", pid=1)
    for slot in range(3):
        assert backend.acquire(slot_key("export:7", slot), f"s{slot}", 30, owner).status == "acquired"
    backend.release(slot_key("export:7", 0), "s0", finished=("w:0:0", 60, "w"))
    for n in range(3):
        backend.rate_take("stripe:1", f"r{n}", Rate(2, 30.0))

    # delays, unique tasks and debounce (rows in the store; the unique key in Redis)
    @app.task(base=SafeTask, shared=False, name="walk.export", unique="export:{user}", unique_ttl=60)
    def export(user: int) -> None: ...

    @app.task(base=SafeTask, shared=False, name="walk.index")
    def index(site: int) -> None: ...

    export.apply_async((1,))
    export.apply_async((2,), countdown=3600)
    index.apply_async((3,), countdown=3600, idempotency_key="walk-3")
    index.apply_async((4,), debounce=timedelta(minutes=1), debounce_key="index:{site}")

    _walk(app, topology, prefix)


def test_the_keys_of_sharded_beats(make_app: Callable[..., Celery], topology: str, tmp_path: Path) -> None:
    """Two beats sharing three shards (``safe_time_beat_shards``): each shard's lease, epoch, leader
    info, state, due set, applied marker and pause expiries, and the beats' heartbeats."""
    prefix = f"walks-{uuid.uuid4().hex[:8]}:"
    app = make_app(
        safe_time_redis_url=topology, safe_time_key_prefix=prefix, safe_time_beat_lease=6, safe_time_beat_shards=3
    )
    app.task(name="walk.noop", shared=False)(_noop)
    names = [f"walk-tenant-{i}" for i in range(9)]
    for name in names:
        save_entry(name, "walk.noop", 1.0, app=app)
    assert {shard_of(name, 3) for name in names} == {0, 1, 2}
    for name in names[:3]:  # a pause with an expiry in each shard of these names
        pause(name, until=timedelta(hours=1), app=app)
    scheds = [SafeScheduler(app=app, schedule_filename=str(tmp_path / f"s{i}"), max_interval=1) for i in range(2)]

    def held() -> set[int]:
        return {s.shard for sched in scheds for s in [sched, *sched.shard_children] if s.keeper.is_leader}

    try:
        wait_for(lambda: held() == {0, 1, 2}, 20, message="every shard held")
        wait_for(
            lambda: ([sched.tick() for sched in scheds], all(entry_history(n, app=app) for n in names[3:]))[1],
            30,
            interval=0.1,
            message="each shard's entries fired",
        )
    finally:
        scheds[1].close()
    try:
        client = create_redis(topology)
        try:
            keys = {k.decode()[len(prefix) :].replace("{beat}", "beat") for k in client.scan_iter(match=prefix + "*")}
        finally:
            client.close()
        # the walk sees each shard's keys and the heartbeats (one beat still runs: its leases are live too)
        assert {"beat:beats", "beat:shard:1:epoch", "beat:shard:2:due", "beat:shard:1:entries:applied"} <= keys
        _walk(app, topology, prefix)
    finally:
        scheds[0].close()


def test_the_keys_of_real_beat_and_worker_processes(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: Any, topology: str
) -> None:
    """A real ``celery beat`` leader and worker: fired slots, history with outcomes, an entry's run
    lease (``overlap``), leader info; then the walk."""
    prefix = f"walkp-{uuid.uuid4().hex[:8]}:"
    schedule = {
        "walkp-fast": {"task": "tests.record", "every": 1, "args": ["walkp-fast"]},
        "walkp-skip": {"task": "tests.overlap_run", "every": 1, "args": ["walkp-skip", 1.5], "overlap": "skip"},
    }
    env = beat_env(schedule, safe_time_beat_lease=4, safe_time_redis_url=topology, safe_time_key_prefix=prefix)
    worker = processes.worker(BEAT_APP, env=env, name="walk-worker")
    beat = processes.beat(BEAT_APP, env=env, name="walk-beat")
    wait_for(lambda: len(runs(redis_client, "walkp-fast")) >= 3, 60, message="runs of walkp-fast")
    ends = "test:overlap:walkp-skip"
    wait_for(lambda: b'"end"' in b"".join(redis_client.lrange(ends, 0, -1)), 60, message="a skip-entry run")
    beat.terminate()
    worker.terminate()
    app = make_app(safe_time_redis_url=topology, safe_time_key_prefix=prefix)
    assert len(entry_history("walkp-fast", app=app)) >= 3
    _walk(app, topology, prefix)


def _walk(app: Celery, topology: str, prefix: str) -> None:
    """Every key under ``prefix`` has a TTL or is on ``PERMANENT``; per-entry permanent keys are bounded."""
    client = create_redis(topology)
    try:
        names = sorted(k.decode() for k in client.scan_iter(match=prefix + "*", count=1000))
        assert len(names) > 10, names  # the scenario wrote what it should
        loose = []
        for name in names:
            bare = name[len(prefix) :].replace("{beat}", "beat")
            if client.pttl(name) >= 0 or any(fnmatch.fnmatchcase(bare, p) for p in PERMANENT):
                continue
            loose.append(bare)
        assert loose == []
        # A deleted entry's runs and changes expire (above); a live entry's are bounded by the history
        # size (a record and an outcome field per run) and the audit size.
        config = get_config(app)
        for name in names:
            bare = name[len(prefix) :].replace("{beat}", "beat")
            if bare.startswith(("beat:history:", "beat:history-slots:")):
                size = client.hlen(name) if client.type(name) == b"hash" else client.zcard(name)
                assert size <= 2 * config.beat_history_size
            if bare.startswith("beat:audit:"):
                assert client.llen(name) <= config.beat_audit_size
    finally:
        for name in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(name)
        client.close()
