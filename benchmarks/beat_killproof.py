"""Beat at SaaS size, the proof: every slot at most once through a ``kill -9`` of the leader, with
10,000 and 1,000,000 runtime entries on Redis coordination, in the same run.

Per size, on a fresh Redis db:

- the entries are saved with ``save_entries``: 10 every second and 50 every minute (crontab ``* * *``)
  with the ``run_all`` misfire policy (a slot missed during the takeover is published late, once: so
  every slot of theirs is expected exactly once), the rest daily at 09:00 in five zones;
- Redis memory: ``INFO memory`` ``used_memory`` before and after the save and after the plan, and
  ``MEMORY USAGE`` per key type (definitions hash, change log, name index, state hash, due set, audit
  lists and fired-slot markers, the per-entry keys sampled);
- two real ``celery beat -S celery_safe_time.SafeScheduler`` processes (lease 6 s): the first one is a
  fresh leader and plans every entry; once its plan is complete the leader is killed (``SIGKILL``)
  50 ms after a minute starts, while the 60 busy entries' slots are due; the standby takes over;
- every message the beats publish is read from the broker queue as it arrives (a poller beside the
  beats, every few ms, with the lease's epoch): per (entry, slot) exactly once / twice or more /
  missing, the time from the epoch change (the lease taken) to the new leader's first publish, and
  the beats' RSS (standby, leader after its plan, the new leader after the takeover);
- then the steady tick of an in-process leader taking over the same state: p50 / p99 over a few
  hundred ticks 20 ms apart (the 10 busy entries fall due every second).

Runs of their own: ``--steady-state-memory`` (what a daily entry adds after 50 runs, and Redis's
own time per guarded slot and per publish), ``--redbeat 100000`` (ours beside celery-redbeat with the
same entries) and ``--ticks 10000,1000000`` (leaders of each size ticked in turn). ``--postgres``: the
kill proof of each size on PostgreSQL coordination (a fresh database, a key prefix per size, the
broker still Redis; the database's growth instead of Redis memory), then the leaders of every size
taking over the plans left and ticked in turn.

``python -m benchmarks.beat_killproof [--postgres] [--sizes 10000,1000000]``; needs the local Redis (and
PostgreSQL with ``--postgres``). Not part of
``make bench`` (a million entries take minutes to save and about 1.4 GB of Redis).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import by_size, md_table, print_report
from tests.helpers import services
from tests.helpers.processes import CeleryProcess

SIZES = (10_000, 1_000_000)
BUSY = 10  # every second
MINUTELY = 50  # every minute, on the minute
LEASE = 6.0
#: 09:00 in these zones is 07:00 to 17:00 UTC: a run in the UTC evening has none of them due
_ZONES = ("Europe/Berlin", "America/New_York", "Europe/London", "America/Chicago", "UTC")
#: how long the new leader runs after the takeover before the beats stop
AFTER_TAKEOVER = 20.0
#: how many of a per-entry key type ``MEMORY USAGE`` samples
MEMORY_SAMPLE = 2000
TICKS = 400


def _app(redis_url: str) -> Any:
    from celery import Celery

    app = Celery("bench", set_as_current=False)
    app.conf.update(broker_url=redis_url, timezone="UTC", beat_max_loop_interval=1, safe_time_beat_lease=LEASE)

    @app.task(name="tests.record", shared=False)
    def record(label: str = "") -> None:  # pragma: no cover - never executed, only published
        return None

    return app


def _specs(n: int) -> list[dict[str, Any]]:
    run_all = {"safe_time_misfire": "run_all"}
    out: list[dict[str, Any]] = []
    for i in range(n):
        spec: dict[str, Any] = {"name": f"tenant-{i}", "task": "tests.record", "args": [f"t{i}"]}
        if i < BUSY:
            spec.update(schedule=1.0, options=run_all)
        elif i < BUSY + MINUTELY:
            spec.update(schedule={"type": "crontab", "minute": "*", "tz": "UTC"}, options=run_all)
        else:
            spec["schedule"] = {
                "type": "crontab", "minute": str(i % 60), "hour": "9", "day_of_week": "*", "day_of_month": "*",
                "month_of_year": "*", "tz": _ZONES[i % len(_ZONES)],
            }  # fmt: skip
        out.append(spec)
    return out


def _used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _usage(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


def _sampled(client: redis.Redis, pattern: str) -> dict[str, float]:
    """Per-key memory of the keys matching ``pattern`` (a sample of them) and how many there are."""
    keys = []
    for key in client.scan_iter(pattern, count=10_000):
        keys.append(key)
        if len(keys) >= MEMORY_SAMPLE:
            break
    count = sum(1 for _ in client.scan_iter(pattern, count=10_000)) if len(keys) >= MEMORY_SAMPLE else len(keys)
    per_key = sum(_usage(client, k) for k in keys) / max(1, len(keys))
    return {"keys": count, "bytes per key": round(per_key, 1), "total MB": round(per_key * count / 1e6, 1)}


def memory_by_type(client: redis.Redis, prefix: str, n: int) -> dict[str, Any]:
    """``MEMORY USAGE`` per key type, in bytes per entry (the per-entry keys sampled)."""
    out: dict[str, Any] = {}
    for label in ("entries", "entries:changed", "entries:names", "state", "due"):
        out[label] = round(_usage(client, f"{prefix}beat:{label}") / n, 1)
    for label in ("audit", "fired", "history", "history-slots"):
        found = _sampled(client, f"{prefix}beat:{label}:*")
        out[f"{label} keys"] = found["keys"]
        out[label] = round(found["bytes per key"] * found["keys"] / n, 1)
        out[f"{label} bytes per key"] = found["bytes per key"]
    return out


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


class Poller(threading.Thread):
    """Reads every message the beats push onto the ``celery`` queue as it arrives (LPUSH: the newest
    are at the head), with the time it saw it, and the lease's epoch and when it changed."""

    def __init__(self, client: redis.Redis, epoch_key: str, read_epoch: Callable[[], int | None] | None = None) -> None:
        super().__init__(daemon=True)
        self.client, self.epoch_key = client, epoch_key
        #: the epoch from elsewhere than a Redis key (PostgreSQL coordination: the lease row)
        self.read_epoch = read_epoch
        self.seen = 0
        self.messages: list[tuple[float, str, str, int]] = []  # (seen at, entry, slot, epoch)
        self.epochs: list[tuple[float, int]] = []  # (seen at, epoch)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.poll()
            except (redis.ConnectionError, redis.TimeoutError):
                # the shared services stall under load: the queue keeps the messages, the next poll reads them
                time.sleep(0.1)
            time.sleep(0.003)
        self.poll()

    def poll(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.epoch_key)
        pipe.llen("celery")
        epoch_raw, length = pipe.execute()
        if self.read_epoch is not None:
            epoch_raw = self.read_epoch()
        now = time.time()
        epoch = int(epoch_raw or 0)
        if not self.epochs or self.epochs[-1][1] != epoch:
            self.epochs.append((now, epoch))
        if length > self.seen:
            # counted from the tail (the oldest): a push between LLEN and LRANGE moves the head only
            for raw in reversed(self.client.lrange("celery", -length, -(self.seen + 1))):
                headers = json.loads(raw)["headers"]
                self.messages.append(
                    (
                        now,
                        headers.get("safe_time_entry"),
                        headers.get("safe_time_slot"),
                        int(headers["safe_time_epoch"]),
                    )
                )
            self.seen = length


def _count(poller: Poller, start: float, end: float) -> dict[str, Any]:
    """Per (entry, slot) of the busy and minutely entries with a slot in [start, end]: exactly once,
    twice or more, missing (a slot on the entry's grid that no message carries)."""
    per: Counter[tuple[str, int]] = Counter()  # (entry, slot in ms)
    for _, entry, slot, _ in poller.messages:
        per[(entry, round(datetime.fromisoformat(slot).timestamp() * 1000))] += 1
    once = twice = missing = 0
    missed: list[tuple[str, int]] = []
    for i in range(BUSY + MINUTELY):
        name = f"tenant-{i}"
        slots = sorted(s for (e, s) in per if e == name)
        step = 1000 if i < BUSY else 60_000
        # an entry with no message in the window: its grid (whole seconds, whole minutes) from the start
        first = slots[0] if slots else -(-round(start * 1000) // step) * step
        for grid in range(first, round(end * 1000) + 1, step):
            if grid >= start * 1000:
                c = per.get((name, grid), 0)
                once += c == 1
                twice += c > 1
                missing += c == 0
                if c == 0:
                    missed.append((name, grid))
    # the daily entries: a zone's 09:00 may fall in the run (09:08 in Chicago is 15:08 UTC): each once
    daily = [c for (e, _), c in per.items() if int(e.split("-")[1]) >= BUSY + MINUTELY]
    return {
        "once": once,
        "twice or more": twice + sum(c > 1 for c in daily),
        "missing": missing,
        "daily slots published once": sum(c == 1 for c in daily),
        "missing slots": missed,
    }


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def steady_ticks(app: Any, tmp: Path) -> dict[str, float]:
    """An in-process leader taking over the state the beats left: its tick, p50 / p99 (ms)."""
    from celery_safe_time.beat.scheduler import SafeScheduler

    sched = SafeScheduler(app=app, schedule_filename=str(tmp / "steady"), max_interval=1)
    try:
        _wait(lambda: sched.keeper.epoch is not None, 30, "the in-process leader's lease")
        started = time.perf_counter()
        sched.tick()
        first = time.perf_counter() - started
        while sched.replanning:
            sched.tick()
        time.sleep(1.1)
        samples = []
        for _ in range(TICKS):
            started = time.perf_counter()
            sched.tick()
            samples.append(time.perf_counter() - started)
            time.sleep(0.02)
    finally:
        sched.close()
    return {"first tick ms": round(first * 1000, 2), **_pcts(samples)}


class _Lease:
    """What the benchmark reads of the leader lease and the plan, on either coordination."""

    def __init__(self, app: Any, client: redis.Redis, postgres: bool) -> None:
        from celery_safe_time.beat.backends import beat_backend
        from celery_safe_time.beat.backends.redis import BeatKeys
        from celery_safe_time.config import get_config

        self.client = client
        self.keys = BeatKeys.for_config(get_config(app))
        self.backend = beat_backend(get_config(app)) if postgres else None

    def held(self) -> bool:
        if self.backend is None:
            return bool(self.client.exists(self.keys.lease))
        return self.backend.lease_view().ttl_ms is not None

    def planned(self, n: int) -> bool:
        """The fresh leader's plan is complete: every entry is due and the applied marker is written
        (a plan under way leaves it empty; the saves put every entry in the due set before it ends)."""
        if self.backend is None:
            return int(self.client.zcard(self.keys.due)) >= n and bool(self.client.get(self.keys.applied))
        return self.backend.due_count() >= n and bool(self.backend.snapshot_meta().marker)

    def holder_pid(self) -> Any:
        if self.backend is None:
            return json.loads(self.client.get(self.keys.info) or "{}").get("pid")
        return self.backend.lease_view().info.get("pid")

    def epoch(self) -> int | None:
        assert self.backend is not None
        return self.backend.lease_view().epoch


def _postgres_app(redis_url: str, postgres_url: str, n: int) -> Any:
    """The benchmark's app on PostgreSQL coordination, each size under a key prefix of its own (its
    rows stay for the interleaved ticks after the kill runs)."""
    app = _app(redis_url)
    app.conf.update(safe_time_coordination_url=postgres_url, safe_time_key_prefix=f"kill-{n}:")
    return app


def _postgres_mb(postgres_url: str) -> float:
    import sqlalchemy as sa

    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            return round(
                int(conn.execute(sa.text("SELECT pg_database_size(current_database())")).scalar_one()) / 1e6, 1
            )
    finally:
        engine.dispose()


def bench_kill(
    redis_url: str, n: int, claim: services.RedisDbClaim, tmp: Path, postgres_url: str | None = None
) -> dict[str, Any]:
    """The kill -9 proof at ``n`` entries; on PostgreSQL coordination with ``postgres_url`` (the broker
    stays Redis: the poller reads the queue there, and the epoch from the lease row)."""
    from celery_safe_time import save_entries
    from celery_safe_time.beat.backends.redis import RedisBeatBackend
    from celery_safe_time.config import get_config

    client = redis.Redis.from_url(redis_url)
    client.flushdb(asynchronous=True)
    app = _app(redis_url) if postgres_url is None else _postgres_app(redis_url, postgres_url, n)
    lease = _Lease(app, client, postgres_url is not None)
    keys = lease.keys
    prefix = keys.due[: -len("beat:due")]
    out: dict[str, Any] = {"entries": n, "load average at start": round(os.getloadavg()[0], 1)}
    if postgres_url is not None:
        out["coordination"] = "postgres"
        before_mb = _postgres_mb(postgres_url)
    before = _used(client)
    specs = _specs(n)  # built before the clock starts, as beat_scale's save does
    started = time.perf_counter()
    save_entries(specs, app=app)
    out["save_entries s"] = round(time.perf_counter() - started, 1)
    out["save_entries per s"] = round(n / (time.perf_counter() - started))
    if postgres_url is None:
        out["used_memory after save, bytes per entry"] = round((_used(client) - before) / n)
    else:
        out["database growth after save, bytes per entry"] = round((_postgres_mb(postgres_url) - before_mb) * 1e6 / n)
    claim.refresh()

    conf: dict[str, Any] = {"safe_time_beat_lease": LEASE}
    if postgres_url is not None:
        conf.update(safe_time_coordination_url=postgres_url, safe_time_key_prefix=app.conf.safe_time_key_prefix)
    env = {
        "SAFE_TIME_TEST_BROKER_URL": redis_url,
        "SAFE_TIME_TEST_BEAT_SCHEDULE": "{}",
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }
    poller = Poller(
        client.__class__.from_url(redis_url), keys.epoch, read_epoch=lease.epoch if postgres_url is not None else None
    )
    poller.start()
    beats = [
        CeleryProcess(
            "tests.apps.beat_app",
            ["beat", "-l", "INFO", "-S", "celery_safe_time.SafeScheduler", "-s", str(tmp / f"beat-{n}-{i}")],
            env,
            tmp,
            f"beat-{n}-{i}",
        )
        for i in range(2)
    ]
    try:
        beats[0].start()
        _wait(lease.held, 60, "the first beat's lease")
        time.sleep(1.0)
        beats[1].start()
        started = time.monotonic()
        # the fresh leader plans a chunk per tick: its plan is complete once every entry is due
        _wait(lambda: lease.planned(n), 1800, "the plan")
        out["fresh plan complete s"] = round(time.monotonic() - started, 1)
        claim.refresh()
        if postgres_url is None:
            out["used_memory after plan, bytes per entry"] = round((_used(client) - before) / n)
        else:
            out["database growth after plan, bytes per entry"] = round(
                (_postgres_mb(postgres_url) - before_mb) * 1e6 / n
            )
        leader_pid = lease.holder_pid()
        leader = next(b for b in beats if b.pid == leader_pid)
        standby = next(b for b in beats if b is not leader)
        # kill 50 ms into a minute: the 60 busy entries' slots are due then
        time.sleep(60 - time.time() % 60 + 0.05)
        out["leader RSS MB"], out["standby RSS MB"] = _rss_mb(leader.pid), _rss_mb(standby.pid)
        killed = time.time()
        leader.kill()
        _wait(lambda: len(poller.epochs) > 1 and poller.epochs[-1][0] > killed, 60, "the takeover")
        taken_at, new_epoch = poller.epochs[-1]
        _wait(lambda: any(m[3] == new_epoch for m in poller.messages), 60, "the new leader's first publish")
        first = next(m for m in poller.messages if m[3] == new_epoch)
        out["kill to lease taken s"] = round(taken_at - killed, 2)
        out["lease taken to first publish s"] = round(first[0] - taken_at, 3)
        time.sleep(AFTER_TAKEOVER)
        out["new leader RSS MB"] = _rss_mb(standby.pid)
        standby.terminate()
    finally:
        for b in beats:
            if b.alive():
                b.kill()
        poller.stop.set()
        poller.join(10)
    # every slot from 10 s before the kill to 3 s before the end
    out["slots"] = _count(poller, killed - 10, poller.messages[-1][0] - 3)
    # a missing slot with its fired marker: marked by the killed leader, which died before its publish
    guard = lease.backend if lease.backend is not None else RedisBeatBackend(get_config(app))
    out["slots"]["missing with a fired marker"] = sum(
        1 for name, slot_ms in out["slots"]["missing slots"] if guard.slot_fired(name, slot_ms / 1000)
    )
    out["messages"] = len(poller.messages)
    with open(tmp / f"messages-{n}.jsonl", "w") as f:  # for a second look at the counts
        for message in poller.messages:
            f.write(json.dumps(message) + "\n")
    if postgres_url is None:
        # the name index (``beat list``, the admin) is built on the first page an operator view reads
        RedisBeatBackend(get_config(app)).entry_page(None, 10)
        out["memory per entry (MEMORY USAGE, bytes)"] = memory_by_type(client, prefix, n)
        out["used_memory MB"] = round(_used(client) / 1e6, 1)
    else:
        out["database MB"] = _postgres_mb(postgres_url)
    claim.refresh()
    out["steady tick"] = steady_ticks(app, tmp)
    out["load average at end"] = round(os.getloadavg()[0], 1)
    client.flushdb(asynchronous=True)
    return out


def run(sizes: list[int]) -> dict[str, Any]:
    claim = services.RedisDbClaim(services.resolve_redis_base())
    results: dict[str, Any] = {}
    try:
        logs = Path(os.environ.get("BENCH_LOG_DIR") or tempfile.mkdtemp(prefix="beat-killproof-"))
        logs.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            results[str(n)] = bench_kill(claim.url, n, claim, logs)
            # each size as soon as it is measured: a million takes minutes
            (logs / f"result-{n}.json").write_text(json.dumps(results[str(n)], indent=2))
    finally:
        redis.Redis.from_url(claim.url).flushdb(asynchronous=True)
        claim.release()
    return results


def run_postgres(sizes: list[int]) -> dict[str, Any]:
    """The kill proof of each size on PostgreSQL coordination (one fresh database, a key prefix per
    size; the broker a Redis db), then the leaders of every size ticked in turn on the states left."""
    claim = services.RedisDbClaim(services.resolve_redis_base())
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    postgres_url = db.url.replace("postgresql://", "postgresql+psycopg://", 1)
    results: dict[str, Any] = {"coordination": "postgres"}
    try:
        logs = Path(os.environ.get("BENCH_LOG_DIR") or tempfile.mkdtemp(prefix="beat-killproof-pg-"))
        logs.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            results[str(n)] = bench_kill(claim.url, n, claim, logs, postgres_url)
            (logs / f"result-pg-{n}.json").write_text(json.dumps(results[str(n)], indent=2))
        apps = {n: _postgres_app(claim.url, postgres_url, n) for n in sizes}
        results["ticks in turn"] = ticks_in_turn(apps, logs)
        (logs / "result-pg-ticks.json").write_text(json.dumps(results["ticks in turn"], indent=2))
    finally:
        from celery_safe_time.coordination import dispose_engines

        dispose_engines()
        db.drop()
        redis.Redis.from_url(claim.url).flushdb(asynchronous=True)
        claim.release()
    return results


def _slots_and_ticks(r: dict[str, Any]) -> tuple[str, str]:
    """A size's slots once / twice or more / missing, and its steady tick p50 / p99 (ms)."""
    s, t = r["slots"], r["steady tick"]
    daily = s.get("daily slots published once", 0)
    also = f" (and {daily:,} daily slots due in the run, each once)" if daily else ""
    return f"{s['once']} / {s['twice or more']} / {s['missing']}{also}", f"{t['p50 ms']} / {t['p99 ms']}"


def _load(r: dict[str, Any]) -> str:
    return f"{r['load average at start']} to {r['load average at end']}"


def markdown_postgres(results: dict[str, Any]) -> str:
    header = (
        "entries (PostgreSQL coordination)", "`save_entries`", "fresh plan", "kill -9 to lease taken (s)",
        "lease taken to first publish (s)", "slots once / twice or more / missing", "steady tick p50 / p99 (ms)",
        "beat RSS standby / leader / new leader (MB)", "database per entry, saved / planned (B)", "load average",
    )  # fmt: skip
    rows = [
        (
            f"{n:,}",
            f"{r['save_entries s']} s ({r['save_entries per s']:,}/s)",
            f"{r['fresh plan complete s']} s",
            r["kill to lease taken s"],
            r["lease taken to first publish s"],
            *_slots_and_ticks(r),
            f"{r['standby RSS MB']} / {r['leader RSS MB']} / {r['new leader RSS MB']}",
            f"{r['database growth after save, bytes per entry']} / {r['database growth after plan, bytes per entry']}",
            _load(r),
        )
        for n, r in by_size(results)
    ]
    tables = [md_table(header, rows, "r" * len(header))]
    ticks = results.get("ticks in turn")
    if ticks:
        sizes = [int(key.split()[0]) for key in ticks if key.endswith(" tick")]
        turns = [
            (
                f"{n:,}",
                ticks[f"{n} takeover first tick ms"],
                f"{ticks[f'{n} tick']['p50 ms']} / {ticks[f'{n} tick']['p99 ms']}",
            )
            for n in sizes
        ]
        tables.append(md_table(("ticked in turn", "takeover first tick (ms)", "tick p50 / p99 (ms)"), turns, "rrr"))
    return "\n\n".join(tables)


def markdown(results: dict[str, Any]) -> str:
    header = (
        "entries", "kill -9 to lease taken (s)", "lease taken to first publish (s)",
        "slots once / twice or more / missing", "steady tick p50 / p99 (ms)",
        "leader RSS after plan / new leader after takeover (MB)",
        "Redis used_memory per entry, saved / planned (B)", "load average",
    )  # fmt: skip
    rows = [
        (
            f"{n:,}",
            r["kill to lease taken s"],
            r["lease taken to first publish s"],
            *_slots_and_ticks(r),
            f"{r['leader RSS MB']} / {r['new leader RSS MB']}",
            f"{r['used_memory after save, bytes per entry']} / {r['used_memory after plan, bytes per entry']}",
            _load(r),
        )
        for n, r in by_size(results)
    ]
    memory = [
        (f"{n:,}", *(r["memory per entry (MEMORY USAGE, bytes)"].get(c) for c in _MEMORY_COLUMNS))
        for n, r in by_size(results)
    ]
    return "\n\n".join(
        (
            md_table(header, rows, "r" * len(header)),
            md_table(("entries", *_MEMORY_COLUMNS), memory, "r" * (len(_MEMORY_COLUMNS) + 1)),
        )
    )


_MEMORY_COLUMNS = (
    "entries", "entries:changed", "entries:names", "state", "due", "audit", "fired", "history", "history-slots",
)  # fmt: skip


#: runs a daily entry keeps in its history by default (safe_time_beat_history_size), and the days a
#: fired-slot marker lives (FIRED_SLOT_TTL): what a daily entry holds once it has run that long
DAYS = 50
MARKER_DAYS = 7


def steady_state_memory(redis_url: str, n: int = 1000) -> dict[str, Any]:
    """``MEMORY USAGE`` per entry of what a daily entry adds once it has run ``DAYS`` days: its run
    history (each run's published record and a worker's outcome) and its fired-slot markers."""
    from celery_safe_time.beat.backends.redis import RedisBeatBackend, beat_scripts, history_keys
    from celery_safe_time.beat.history import published_record
    from celery_safe_time.beat.state import slot_id
    from celery_safe_time.config import get_config

    client = redis.Redis.from_url(redis_url)
    client.flushdb(asynchronous=True)
    config = get_config(_app(redis_url))
    backend = RedisBeatBackend(config, client)
    scripts = beat_scripts(client)
    day0 = 1_765_000_000.0
    outcome = json.dumps(
        {"outcome": "succeeded", "finished": day0, "runtime": 0.012345, "worker": "celery@worker-1", "retries": 0},
        separators=(",", ":"),
    )
    for i in range(n):
        name = f"tenant-{i}"
        pipe = client.pipeline(transaction=False)
        for day in range(DAYS):
            slot = day0 + day * 86400
            record = published_record(slot, slot + 0.01, str(uuid.uuid4()), 3, "beat-host-1")
            keys = history_keys(config, name)
            scripts["history_record"](keys=keys, args=[slot_id(slot), record, config.beat_history_size], client=pipe)
            pipe.hset(keys[0], slot_id(slot) + ":o", outcome)
        pipe.execute()
        backend.claim_slots(name, [day0 + day * 86400 for day in range(DAYS - MARKER_DAYS, DAYS)], "3:abcdef")
    out = {}
    for label in ("fired", "history", "history-slots"):
        keys = list(client.scan_iter(f"{config.key('beat:')}{label}:*", count=10_000))
        out[label] = round(sum(_usage(client, k) for k in keys) / n, 1)
    client.flushdb(asynchronous=True)
    return out


def _evalsha_usec(client: redis.Redis, command: str = "evalsha") -> tuple[int, float]:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def redis_slot_cost(redis_url: str, n: int = 20_000, chunk: int = 500, history: bool = True) -> dict[str, Any]:
    """Redis's own time per dispatched slot: ``n`` guarded dispatches with their run records, ``chunk``
    per pipelined round trip as the leader sends them, from ``INFO commandstats`` (``evalsha`` usec,
    server-wide: another client's scripts in the same seconds count too, so it is an upper bound)."""
    from celery_safe_time.beat.backends.base import SlotWrite
    from celery_safe_time.beat.backends.redis import RedisBeatBackend
    from celery_safe_time.beat.history import published_record
    from celery_safe_time.config import get_config

    client = redis.Redis.from_url(redis_url)
    client.flushdb(asynchronous=True)
    app = _app(redis_url)
    if not history:  # the run record off: the guard, the state and the due set only
        app.conf.safe_time_beat_history_size = 0
    backend = RedisBeatBackend(get_config(app), client)
    lease = backend.make_lease()
    epoch = lease.acquire(time.time())
    assert epoch is not None
    slot = 1_765_000_000.0
    state = json.dumps({"last": slot, "next": slot + 86400, "sig": "0123456789abcdef"})
    writes = [
        SlotWrite(f"tenant-{i}", state, slot + 86400, slot, published_record(slot, slot, str(uuid.uuid4()), epoch, "h"))
        for i in range(n)
    ]
    calls, usec = _evalsha_usec(client)
    started = time.perf_counter()
    for i in range(0, n, chunk):
        lease.write_slots(epoch, writes[i : i + chunk])
    wall = time.perf_counter() - started
    calls2, usec2 = _evalsha_usec(client)
    # the publish: a message of the size Celery sends for such an entry, one LPUSH each, pipelined
    message = b"x" * 1100
    pushes, push_usec = _evalsha_usec(client, "lpush")
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.lpush("bench-publish", message)
        if i % chunk == chunk - 1:
            pipe.execute()
    pipe.execute()
    pushes2, push_usec2 = _evalsha_usec(client, "lpush")
    client.flushdb(asynchronous=True)
    return {
        "redis usec per publish (lpush of 1,100 bytes, server-wide)": round((push_usec2 - push_usec) / n, 1),
        "lpush calls counted": pushes2 - pushes,
        "slots": n,
        "redis usec per slot (evalsha, server-wide)": round((usec2 - usec) / n, 1),
        "evalsha calls counted": calls2 - calls,
        "client wall usec per slot": round(wall / n * 1e6, 1),
        "load average": round(os.getloadavg()[0], 1),
    }


def _pcts(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50 ms": round(ordered[len(ordered) // 2] * 1000, 2),
        "p99 ms": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000, 2),
    }


def redbeat_beside(redis_url: str, n: int, tmp: Path) -> dict[str, Any]:
    """Ours and celery-redbeat with the same ``n`` entries (10 every second, the rest daily at 09:00) in
    one db: a new leader's first tick, then their ticks in turn (the same noise on both), and Redis
    memory per entry (``MEMORY USAGE``; ours: definitions, change log, state, due set and audit)."""
    from celery.schedules import crontab as celery_crontab
    from redbeat import RedBeatScheduler, RedBeatSchedulerEntry

    from celery_safe_time import save_entries
    from celery_safe_time.beat.scheduler import SafeScheduler
    from celery_safe_time.config import get_config

    client = redis.Redis.from_url(redis_url)
    client.flushdb(asynchronous=True)
    out: dict[str, Any] = {"entries": n, "load average at start": round(os.getloadavg()[0], 1)}
    app = _app(redis_url)
    specs = _specs(n)
    started = time.perf_counter()
    save_entries(specs, app=app)
    out["ours save s"] = round(time.perf_counter() - started, 1)
    red_app = _app(redis_url)
    red_app.conf.update(redbeat_redis_url=redis_url, redbeat_lock_key=None)
    started = time.perf_counter()
    for i, spec in enumerate(specs):
        schedule: Any = 1.0 if i < BUSY else celery_crontab(minute=str(i % 60), hour="9")
        if BUSY <= i < BUSY + MINUTELY:
            schedule = celery_crontab()
        entry = RedBeatSchedulerEntry(spec["name"], spec["task"], schedule, args=spec["args"], app=red_app)
        entry.save()
    out["redbeat save s"] = round(time.perf_counter() - started, 1)

    # ours: a fresh leader plans every entry (a chunk per tick), then a new leader takes over from it
    fresh = SafeScheduler(app=app, schedule_filename=str(tmp / f"rb-fresh-{n}"), max_interval=1)
    _wait(lambda: fresh.keeper.epoch is not None, 30, "the lease")
    fresh.tick()
    while fresh.replanning:
        fresh.tick()
    fresh.close()
    safe = SafeScheduler(app=app, schedule_filename=str(tmp / f"rb-{n}"), max_interval=1)
    _wait(lambda: safe.keeper.epoch is not None, 30, "the lease")
    started = time.perf_counter()
    safe.tick()
    out["ours takeover first tick s"] = round(time.perf_counter() - started, 3)

    red = RedBeatScheduler(app=red_app, max_interval=1, lock_key=None)
    red.lock_key = None
    try:
        started = time.perf_counter()
        red.tick()
        out["redbeat first tick s"] = round(time.perf_counter() - started, 3)
        time.sleep(1.1)
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(TICKS):
            for tick, samples in ((safe.tick, ours), (red.tick, theirs)):
                started = time.perf_counter()
                tick()
                samples.append(time.perf_counter() - started)
            time.sleep(0.02)
        out["ours tick"], out["redbeat tick"] = _pcts(ours), _pcts(theirs)
    finally:
        red.close()
        safe.close()
    prefix = get_config(app).key("")
    mem = memory_by_type(client, prefix, n)
    out["ours bytes per entry"] = round(sum(mem[k] for k in ("entries", "entries:changed", "state", "due", "audit")))
    red_keys = []
    for key in client.scan_iter("redbeat:tenant-*", count=10_000):
        red_keys.append(key)
        if len(red_keys) >= MEMORY_SAMPLE:
            break
    per_key = sum(_usage(client, k) for k in red_keys) / max(1, len(red_keys))
    out["redbeat bytes per entry"] = round(per_key + _usage(client, "redbeat::schedule") / n)
    out["load average at end"] = round(os.getloadavg()[0], 1)
    client.flushdb(asynchronous=True)
    return out


def interleaved_ticks(redis_url: str, sizes: list[int], tmp: Path) -> dict[str, Any]:
    """One leader per size, each under a key prefix of its own in one db, taking over a complete plan,
    ticked in turn (the same noise on each): p50 / p99 of their ticks (10 entries due every second)."""
    from celery_safe_time import save_entries
    from celery_safe_time.beat.scheduler import SafeScheduler

    client = redis.Redis.from_url(redis_url)
    client.flushdb(asynchronous=True)
    apps = {}
    for n in sizes:
        app = apps[n] = _app(redis_url)
        app.conf.safe_time_key_prefix = f"ticks-{n}:"
        save_entries(_specs(n), app=app)
        fresh = SafeScheduler(app=app, schedule_filename=str(tmp / f"ticks-fresh-{n}"), max_interval=1)
        _wait(lambda fresh=fresh: fresh.keeper.epoch is not None, 30, "the lease")
        fresh.tick()
        while fresh.replanning:
            fresh.tick()
        fresh.close()
    out = ticks_in_turn(apps, tmp)
    client.flushdb(asynchronous=True)
    return out


def ticks_in_turn(apps: dict[int, Any], tmp: Path) -> dict[str, Any]:
    """A leader per app (each size's, its plan complete) taking over, ticked in turn (the same noise on
    each): the takeover's first tick, and p50 / p99 of their ticks (10 entries due every second)."""
    from celery_safe_time.beat.scheduler import SafeScheduler

    out: dict[str, Any] = {"load average at start": round(os.getloadavg()[0], 1)}
    leaders: dict[int, Any] = {}
    sizes = list(apps)
    try:
        for n, app in apps.items():
            leaders[n] = SafeScheduler(app=app, schedule_filename=str(tmp / f"ticks-{n}"), max_interval=1)
            _wait(lambda n=n: leaders[n].keeper.epoch is not None, 30, "the lease")
            started = time.perf_counter()
            leaders[n].tick()
            out[f"{n} takeover first tick ms"] = round((time.perf_counter() - started) * 1000, 2)
        time.sleep(1.1)
        samples: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(2 * TICKS):
            for n, leader in leaders.items():
                started = time.perf_counter()
                leader.tick()
                samples[n].append(time.perf_counter() - started)
            time.sleep(0.02)
        for n in sizes:
            out[f"{n} tick"] = _pcts(samples[n])
    finally:
        for leader in leaders.values():
            leader.close()
    out["load average at end"] = round(os.getloadavg()[0], 1)
    return out


@contextlib.contextmanager
def claimed_db() -> Iterator[tuple[str, Path]]:
    """A Redis db of its own and a scratch folder for one run; the db is emptied after."""
    claim = services.RedisDbClaim(services.resolve_redis_base())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            yield claim.url, Path(tmp)
    finally:
        redis.Redis.from_url(claim.url).flushdb(asynchronous=True)
        claim.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="Entry counts, comma-separated.")
    parser.add_argument(
        "--steady-state-memory",
        action="store_true",
        help="Only a daily entry's memory after 50 days, and Redis time per slot.",
    )
    parser.add_argument("--redbeat", default=None, help="Only ours beside celery-redbeat, at these sizes.")
    parser.add_argument("--ticks", default=None, help="Only the steady tick of these sizes, ticked in turn.")
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="On PostgreSQL coordination (a fresh database; the broker stays Redis), then the sizes ticked in turn.",
    )
    args = parser.parse_args(argv)
    if args.postgres:
        results = run_postgres([int(s) for s in args.sizes.split(",")])
        return print_report(markdown_postgres(results), results)
    if args.ticks:
        with claimed_db() as (url, tmp):
            sizes = [int(x) for x in args.ticks.split(",")]
            print(json.dumps({"interleaved ticks": interleaved_ticks(url, sizes, tmp)}, indent=2))
        return 0
    if args.redbeat:
        with claimed_db() as (url, tmp):
            for n in (int(x) for x in args.redbeat.split(",")):
                print(json.dumps({"redbeat beside": redbeat_beside(url, n, tmp)}, indent=2), flush=True)
        return 0
    if args.steady_state_memory:
        claim = services.RedisDbClaim(services.resolve_redis_base())
        try:
            print(json.dumps({"per entry after 50 days": steady_state_memory(claim.url)}, indent=2))
            print(json.dumps({"redis cost per slot": redis_slot_cost(claim.url)}, indent=2))
            print(json.dumps({"without history": redis_slot_cost(claim.url, history=False)}, indent=2))
        finally:
            claim.release()
        return 0
    results = run([int(s) for s in args.sizes.split(",")])
    return print_report(markdown(results), results)


if __name__ == "__main__":
    import sys

    sys.exit(main())
