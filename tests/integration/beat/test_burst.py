"""The burst (Redis broker; Redis and PostgreSQL coordination): every tenant's entry due in the
same minute, fired by one leader a chunk at a time (one guard round trip and one broker round trip
per chunk; on Redis it reads only what is due), each slot exactly once; a leader that loses its lease
half way publishes none of the rest. Small size (2,000 entries) with the leader's threshold lowered,
so the behaviour at scale is what runs; the leader's clock is moved to just before the burst instead
of waiting for it."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import save_entries
from tests.helpers.beat import burst_cron, burst_hour, leader_at_burst
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

TENANTS = 2000
BATCH_LINE = "published %d due slot(s) in one batch"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _burst_app(make_app: Callable[..., Celery], hour: int, **conf: Any) -> Celery:
    """An app with ``TENANTS`` runtime entries, all daily at ``hour``:00 (:func:`burst_cron`)."""
    app = make_app(safe_time_beat_lease=3, beat_schedule={}, **conf)
    app.task(name="t.burst_noop", shared=False)(_noop)
    cron = burst_cron(hour)
    entries = [{"name": f"tenant-{i}", "task": "t.burst_noop", "schedule": cron, "args": [i]} for i in range(TENANTS)]
    assert save_entries(entries, app=app) == TENANTS
    return app


@pytest.fixture
def hour() -> int:
    return burst_hour(time.time())


@pytest.fixture
def app(make_app: Callable[..., Celery], hour: int) -> Celery:
    return _burst_app(make_app, hour)


def _queued(client: redis.Redis) -> dict[str, list[str]]:
    """The published messages' slots by entry, read from the broker's queue."""
    out: dict[str, list[str]] = {}
    for raw in client.lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        out.setdefault(headers[C.HEADER_ENTRY], []).append(headers[C.HEADER_SLOT])
    return out


def _batches(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [
        int(r.args[0])  # type: ignore[index]
        for r in caplog.records
        if r.name == "celery_safe_time.beat.scheduler" and r.msg == "beat: " + BATCH_LINE
    ]


def test_a_burst_is_published_in_chunks_each_slot_exactly_once(
    make_app: Callable[..., Celery],
    coordination: dict[str, Any],
    hour: int,
    tmp_path: Path,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = _burst_app(make_app, hour, **coordination)
    caplog.set_level(logging.DEBUG, logger="celery_safe_time.beat.scheduler")
    sched, burst = leader_at_burst(app, tmp_path, hour)
    assert sched.lazy == sched.backend.reads_due_only  # PostgreSQL coordination loads every entry
    try:
        wait_for(lambda: (sched.tick(), redis_client.llen("celery") >= TENANTS)[1], 120, interval=0.01)
        # nothing left due at the burst: ticks on publish nothing more
        for _ in range(3):
            sched.tick()
    finally:
        sched.close()
    queued = _queued(redis_client)
    slot = datetime.fromtimestamp(burst, ZoneInfo("UTC")).isoformat()
    assert sorted(queued) == sorted(f"tenant-{i}" for i in range(TENANTS))
    assert all(slots == [slot] for slots in queued.values())  # each burst slot exactly once
    batches = _batches(caplog)
    assert sum(batches) == TENANTS
    # a chunk of due entries per broker round trip, not a round trip per entry
    assert max(batches) <= C.BEAT_DUE_BATCH
    assert len(batches) == math.ceil(TENANTS / C.BEAT_DUE_BATCH)


def test_a_leader_that_loses_its_lease_mid_burst_publishes_none_of_the_rest(
    app: Celery, hour: int, tmp_path: Path, redis_client: redis.Redis
) -> None:
    sched, _ = leader_at_burst(app, tmp_path, hour)
    try:
        wait_for(lambda: (sched.tick(), redis_client.llen("celery") > 0)[1], 60, interval=0.01)
        published = redis_client.llen("celery")
        assert 0 < published < TENANTS
        # another beat holds the lease now (its token in the lease key): the next chunk's guard refuses
        lease = sched.backend.keys.lease
        redis_client.set(lease, "another-beat", px=60_000)
        sched.tick()
        assert not sched.keeper.is_leader
        for _ in range(3):
            sched.tick()
        assert redis_client.llen("celery") == published
    finally:
        sched.close()
