"""Helpers for the beat tests: env for ``tests.apps.beat_app``, run records, and a beat's shard keepers
driven by hand."""

from __future__ import annotations

import collections
import json
import re
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import redis
from celery import Celery

from celery_safe_time.beat.backends import BeatBackend
from celery_safe_time.beat.leader import LeaderKeeper
from celery_safe_time.beat.scheduler import SafeScheduler
from celery_safe_time.beat.shards import ShardGate
from tests.helpers.processes import wait_for

BEAT_APP = "tests.apps.beat_app"


def beat_env(schedule: dict[str, Any], **conf: Any) -> dict[str, str]:
    return {
        "SAFE_TIME_TEST_BEAT_SCHEDULE": json.dumps(schedule),
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }


def published_slots(log: str, name: str) -> list[float]:
    """The slots of entry ``name`` (task ``tests.record``) a beat's log says it published, as epoch
    seconds: the runs a worker has recorded can lag behind them on a loaded machine."""
    sent = re.findall(rf"sending due task {re.escape(name)} \(tests\.record\) slot (\S+)", log)
    return [datetime.fromisoformat(slot).timestamp() for slot in sent]


def runs(client: redis.Redis, label: str | None = None) -> list[dict[str, Any]]:
    """Executions recorded by ``tests.record`` (in order), optionally for one label."""
    out = [json.loads(raw) for raw in client.lrange("test:runs", 0, -1)]
    return [r for r in out if label is None or r["label"] == label]


def settle(client: redis.Redis, quiet: float = 2.0) -> list[dict[str, Any]]:
    """Wait until the worker has drained what was published (no new run recorded for ``quiet``
    seconds), then return the runs. Looked at often, so it returns once the quiet time has passed
    rather than at the next multiple of it."""
    count, changed = client.llen("test:runs"), time.monotonic()
    while time.monotonic() - changed < quiet:
        time.sleep(0.2)
        now = client.llen("test:runs")
        if now != count:
            count, changed = now, time.monotonic()
    return runs(client)


def slots(client: redis.Redis, label: str) -> list[str]:
    return [r["headers"].get("safe_time_slot") for r in runs(client, label)]


def duplicates(client: redis.Redis, label: str | None = None) -> dict[tuple[str, str], int]:
    """(label, slot) pairs executed more than once."""
    count = collections.Counter((r["label"], r["headers"].get("safe_time_slot")) for r in runs(client, label))
    return {key: n for key, n in count.items() if n > 1}


def leader_pid(client: redis.Redis, prefix: str = "safe_time:") -> int | None:
    raw = client.get(prefix + "beat:leader")
    return int(json.loads(raw)["pid"]) if raw else None


def coordination_settings(postgres_url: str) -> dict[str, str]:
    """App settings for PostgreSQL coordination on ``postgres_url``, under a key prefix of their own
    (so tests sharing the session's database never meet; the prefix is the rows' namespace)."""
    return {"safe_time_coordination_url": postgres_url, "safe_time_key_prefix": f"t{uuid.uuid4().hex[:10]}:"}


_BACKENDS: dict[str, Any] = {}


def holder_pid(client: redis.Redis, coordination: dict[str, Any]) -> int | None:
    """The pid of the beat holding the lease, on the backend ``coordination`` chooses ({}: Redis)."""
    url = coordination.get("safe_time_coordination_url")
    if not url:
        return leader_pid(client)
    key = f"{url} {coordination['safe_time_key_prefix']}"
    backend = _BACKENDS.get(key)
    if backend is None:
        from celery import Celery

        from celery_safe_time.beat.backends import beat_backend
        from celery_safe_time.config import get_config

        app = Celery("holder", set_as_current=False)
        app.conf.update(broker_url="memory://", **coordination)
        backend = _BACKENDS[key] = beat_backend(get_config(app))
    pid = backend.lease_view().info.get("pid")
    return int(pid) if pid is not None else None


#: The zone of a test's burst (:func:`burst_cron`).
BURST_ZONE = "Europe/Berlin"


def burst_hour(now: float) -> int:
    """The hour of the day in ``BURST_ZONE`` a burst is due at: hours after ``now`` (at least one), so no
    slot of it lies between the real clock, where its entries are saved, and the leader's clock moved
    to just before it (a slot in between is a missed one, fired at once), and clear of the night's
    DST change (02:00 to 03:00)."""
    hour = (datetime.fromtimestamp(now, ZoneInfo(BURST_ZONE)).hour + 3) % 24
    return 4 if hour in (2, 3) else hour


def burst_cron(hour: int) -> dict[str, str]:
    """The schedule spec of a burst's entries: daily at ``hour``:00 in ``BURST_ZONE``."""
    return {
        "type": "crontab", "minute": "0", "hour": str(hour), "day_of_week": "*", "day_of_month": "*",
        "month_of_year": "*", "tz": BURST_ZONE,
    }  # fmt: skip


def burst_after(now: float, hour: int) -> float:
    """The first ``hour``:00 in ``BURST_ZONE`` after ``now``."""
    local = datetime.fromtimestamp(now, ZoneInfo(BURST_ZONE))
    at = local.replace(hour=hour, minute=0, second=0, microsecond=0)
    if at.timestamp() <= now:
        at = (at + timedelta(days=1)).replace(hour=hour)
    return at.timestamp()


class ShiftedClock:
    """A scheduler's clock moved by ``shift`` seconds (the burst comes when the test wants it)."""

    def __init__(self, clock: Any, shift: float) -> None:
        self.clock, self.shift = clock, shift

    def time(self) -> float:
        return float(self.clock.time()) + self.shift

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clock, name)


def leader_at_burst(app: Celery, tmp_path: Path, hour: int) -> tuple[SafeScheduler, float]:
    """A leader that has planned every entry (next slot: the burst at ``hour``:00, see
    :func:`burst_hour`) and whose clock now reads a tenth of a second before it; the burst's time."""
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "beat"), max_interval=1)
    try:
        sched.lazy_threshold = 100  # as a leader with 10,000 entries or more: reads only what is due
        wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
        real = sched.clock
        burst = burst_after(real.time(), hour)
        clock = ShiftedClock(real, burst - 600 - real.time())
        sched.clock = clock
        # A fresh leader plans a chunk per tick: tick until its plan is complete.
        wait_for(
            lambda: (sched.tick(), sched._reconciled is not None and not sched.replanning)[1],
            60,
            interval=0.05,
            message="the plan",
        )
        assert sched.backend.head()[0][1] == burst  # every entry's next fire is the burst
        clock.shift = burst - 0.1 - real.time()
    except BaseException:
        sched.close()  # a leader left running holds the lease the next test's leader waits for
        raise
    return sched, burst


class ShardBeat:
    """One beat process's shard gate and keepers on ``root`` (its config's shards and lease), driven by
    hand: ``round()`` is one attempt of each keeper, as each keeper's thread makes once per renew
    interval. ``monotonic`` times the gate and the acquires (a test's clock, where time is injected)."""

    def __init__(self, root: BeatBackend, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        shards, lease = root.config.beat_shards, root.config.beat_lease
        self.gate = ShardGate(shards, lease, root.beats_heartbeat, root.clock.time, monotonic=monotonic)
        self.keepers: list[LeaderKeeper] = []
        for shard in range(shards):
            backend = root if shard == 0 else root.for_shard(shard)
            keeper = LeaderKeeper(
                backend.make_lease(), backend.clock, root.config, sender=self, errors=backend.errors, shard=shard
            )
            keeper.join(self.gate)
            keeper.lease_clock = monotonic
            self.keepers.append(keeper)

    def round(self) -> None:
        for keeper in self.keepers:
            keeper._attempt()

    def held(self) -> set[int]:
        return {k.shard for k in self.keepers if k.is_leader}
