"""Beat at SaaS size: one Redis leader with 10,000 and 100,000 runtime entries (1,000,000 with
``--sizes``), 10 every second and the rest daily at 09:00 in their tenant's timezone; with
``--postgres``, on PostgreSQL coordination instead (a fresh database; the broker stays Redis).

Per size, in the same run and on the same stored entries:

- ``save_entries``: entries stored per second (validated, a chunk per round trip), beside
  ``save_entry`` one at a time (the baseline: 2,000 of them, in the same run);
- a fresh leader's first tick (no schedule state in Redis: it plans every entry, a chunk per tick,
  firing what is due in between), how long after taking the lease it published its first slot and
  finished its plan; a takeover's first tick (the previous leader's state and marker in Redis) and
  first slot; wall and CPU seconds, and the growth of the beat process's RSS over both;
- the steady ticks after the takeover (``STEADY_SECONDS`` of them, the busy entries firing every
  second): their median and p99 duration;
- each measured three times, each leader in a process of its own so RSS is its own: a leader that
  reads only what is due (this release, from ``BEAT_LAZY_ENTRIES`` runtime entries on) after
  ``save_entries`` (which planned each entry's first slot: the fresh leader finds them due), the same
  leader once the schedule state is lost (state and due set deleted, the definitions kept: it plans
  every entry before the ones it has not reached are due), and one that loads every entry
  (``lazy_threshold`` raised past the count: what every leader did before).

And the burst (100,000 entries; ``--quick``: 2,000): every entry daily at one hour in one zone
(hours after the real clock, ``tests.helpers.beat.burst_hour``), a fresh leader plans them, its clock
is moved to just before that hour (no waiting for it), and it ticks until every slot is published: the
time from the burst to the last publish, the slots per second, the leader's
CPU, and each entry's messages counted in the broker queue (exactly once). Beside it, the same burst
published with one broker round trip per slot (what a transport without batches gets), and the
batched burst on PostgreSQL coordination (a fresh database; the broker stays Redis).

``save_entries`` on PostgreSQL is also measured as it stored a chunk before (a transaction per entry,
``SAVE_BEFORE`` entries), beside a chunk per transaction.

``--save-only`` measures only ``save_entries``, on Redis and on PostgreSQL coordination (a fresh
database per run), at ``--sizes``: entries stored per second (wall, and per second of the caller's
CPU), and at 100,000 or fewer a re-import of the same entries (nothing changes). ``--save-limit S``
gives a run no more entries after S seconds (its rate is of those it took); ``--icu`` adds a
PostgreSQL database collated by ICU's en-US. With ``--baseline DIR`` (a checkout of an earlier
commit, e.g. ``git archive main | tar -x -C DIR``) each run is made by that code too, in the same
run, each in a process of its own.

``python -m benchmarks.beat_scale [--quick] [--postgres] [--sizes 10000,100000,1000000] [--burst-only 100000]
[--save-only [--icu] [--baseline DIR]]``; needs the local Redis (and PostgreSQL with ``--postgres`` or ``--save-only``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import by_size, md_table, print_report
from tests.helpers import services

SIZES = (10_000, 100_000)
SIZES_QUICK = (10_000,)
BUSY = 10
#: how many entries ``save_entry`` saves one at a time (the baseline of ``save_entries``)
SINGLE_SAVES = 2000
#: how many entries ``save_entries`` stores as it did before on PostgreSQL (a transaction per entry)
SAVE_BEFORE = 3_000
#: how long the steady ticks after a takeover are measured
STEADY_SECONDS = 5.0
#: the key prefix (the rows' namespace) of the leaders on PostgreSQL coordination
SCALE_PREFIX = "bench-scale:"
_ZONES = ("Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "UTC")
ROOT = Path(__file__).resolve().parents[1]


def _app(redis_url: str, coordination: str | None = None, prefix: str = "bench-burst:") -> Any:
    from celery import Celery

    app = Celery("bench", set_as_current=False)
    app.conf.update(
        broker_url=redis_url, timezone="UTC", beat_max_loop_interval=1, safe_time_beat_lease=6, beat_schedule={}
    )
    if coordination:  # PostgreSQL coordination (the broker stays Redis)
        app.conf.update(safe_time_coordination_url=coordination, safe_time_key_prefix=prefix)

    @app.task(name="bench.noop", shared=False)
    def noop(*args: Any) -> None:  # pragma: no cover - never executed, only published
        return None

    return app


def _specs(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        schedule: Any = 1.0
        if i >= BUSY:
            schedule = {
                "type": "crontab", "minute": str(i % 60), "hour": "9", "day_of_week": "*", "day_of_month": "*",
                "month_of_year": "*", "tz": _ZONES[i % len(_ZONES)],
            }  # fmt: skip
        out.append({"name": f"tenant-{i}", "task": "bench.noop", "schedule": schedule, "args": [i]})
    return out


def _save_one_at_a_time(app: Any, specs: list[dict[str, Any]]) -> tuple[int, int]:
    """Entries stored per second (wall, caller's CPU) by ``save_entry``, one call each."""
    from celery_safe_time import save_entry

    started, cpu = time.perf_counter(), time.process_time()
    for spec in specs:
        save_entry(spec["name"], spec["task"], spec["schedule"], args=spec["args"], app=app)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return round(len(specs) / seconds), round(len(specs) / cpu)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _timed(fn: Any) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"s": round(time.perf_counter() - wall, 3), "cpu_s": round(time.process_time() - cpu, 3)}


def _steady(sched: Any, seconds: float) -> dict[str, float]:
    """Tick as beat does (sleeping what the tick asks, at most 50 ms) for ``seconds``: the median
    and p99 tick duration in milliseconds."""
    took: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        wait = sched.tick()
        took.append(time.perf_counter() - started)
        time.sleep(max(0.0, min(wait, 0.05)))
    took.sort()
    return {
        "ticks": len(took),
        "p50_ms": round(took[len(took) // 2] * 1e3, 2),
        "p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1e3, 2),
    }


def leader_child(redis_url: str, lazy: bool, coordination: str | None = None) -> dict[str, Any]:
    """In a process of its own: a fresh leader's first tick, then a takeover's, its steady ticks,
    and the RSS growth."""
    from celery_safe_time import signals
    from celery_safe_time.beat.scheduler import SafeScheduler

    app = _app(redis_url, coordination, SCALE_PREFIX)
    out: dict[str, Any] = {}
    published: list[float] = []  # perf_counter of each published slot

    def on_sent(sender: Any, **kwargs: Any) -> None:
        published.append(time.perf_counter())

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    with tempfile.TemporaryDirectory() as tmp:
        start_rss = _rss_mb()
        for phase in ("fresh", "takeover"):
            sched = SafeScheduler(app=app, schedule_filename=str(Path(tmp) / phase), max_interval=1)
            if not lazy:
                sched.lazy_threshold = 1 << 62  # load every entry, as a leader did before
            deadline = time.monotonic() + 30
            while sched.keeper.epoch is None and time.monotonic() < deadline:
                time.sleep(0.02)
            published.clear()
            started, cpu = time.perf_counter(), time.process_time()
            out[phase] = _timed(sched.tick)
            # the plan of every entry goes on a chunk per tick: tick until it is complete (a takeover's
            # next leader needs its marker) and, at most 30 s, until the first slot is published
            ticks = 1
            deadline = time.monotonic() + 30
            while sched.replanning or (not published and time.monotonic() < deadline):
                wait = sched.tick()
                ticks += 1
                if not sched.replanning and not published:
                    time.sleep(min(wait, 0.05))
            out[f"{phase} plan complete"] = {
                "s": round(time.perf_counter() - started, 3),
                "cpu_s": round(time.process_time() - cpu, 3),
                "ticks": ticks,
            }
            out[f"{phase} first slot s"] = round(published[0] - started, 3) if published else None
            out[f"{phase} reads only due"] = sched.lazy
            if phase == "takeover":
                out["steady tick"] = _steady(sched, STEADY_SECONDS)
            out[f"rss after {phase} MB"] = round(_rss_mb() - start_rss, 1)
            sched.close()
    return out


BURST_SIZES = (100_000,)
BURST_SIZES_QUICK = (2_000,)
#: how long before the burst the leader is planned, and how long before it the firing loop starts
BURST_PLAN_AHEAD = 300.0
BURST_LEAD = 1.0
#: how long after the burst the benchmark stops waiting for the rest of the slots
BURST_GIVE_UP = 300.0


def _burst_specs(n: int, hour: int) -> list[dict[str, Any]]:
    """``n`` tenants, all daily at ``hour``:00 in one zone: one minute with every entry due."""
    from tests.helpers.beat import burst_cron

    return [{"name": f"tenant-{i}", "task": "bench.noop", "schedule": burst_cron(hour), "args": [i]} for i in range(n)]


def _tick_until_planned(sched: Any) -> None:
    sched.tick()
    while sched.replanning:
        sched.tick()


def burst_child(redis_url: str, n: int, hour: int, unbatched: bool, coordination: str | None = None) -> dict[str, Any]:
    """In a process of its own: plan ``n`` entries due at ``hour``:00, move the leader's clock to just
    before it, and tick until every slot is published; time from the burst to the last publish."""
    from celery_safe_time.beat.scheduler import SafeScheduler
    from tests.helpers.beat import ShiftedClock, burst_after

    app = _app(redis_url, coordination)
    out: dict[str, Any] = {"entries": n}
    with tempfile.TemporaryDirectory() as tmp:
        sched = SafeScheduler(app=app, schedule_filename=str(Path(tmp) / "burst"), max_interval=1)
        sched.lazy_threshold = min(sched.lazy_threshold, n // 2)  # a small run reads only due entries too
        if unbatched:  # one publish round trip per slot (what a broker without batches gets)

            def one_by_one(allowed: list[tuple[Any, float]], epoch: int) -> None:
                for entry, slot in allowed:
                    sched.publish(entry, slot, epoch)

            sched.publish_many = one_by_one  # type: ignore[method-assign]
        deadline = time.monotonic() + 30
        while sched.keeper.epoch is None and time.monotonic() < deadline:
            time.sleep(0.02)
        real = sched.clock
        burst = burst_after(real.time(), hour)
        clock = ShiftedClock(real, burst - BURST_PLAN_AHEAD - real.time())
        sched.clock = clock
        # A fresh leader plans a chunk per tick: every entry planned (next slot the burst) before it comes.
        out["plan"] = _timed(lambda: _tick_until_planned(sched))
        out["reads only due"] = sched.lazy
        clock.shift = burst - BURST_LEAD - real.time()
        client = redis.Redis.from_url(redis_url)
        queued = client.llen("celery")
        cpu = time.process_time()
        ticks = 0
        last = burst
        while clock.time() < burst + BURST_GIVE_UP:
            sent_before = client.llen("celery")
            wait = sched.tick()
            ticks += 1
            sched_sent = client.llen("celery")
            if sched_sent > sent_before:
                last = clock.time()
            if sched_sent - queued >= n and clock.time() > burst:
                break
            if wait > 0:
                time.sleep(min(wait, 0.05))
        out["cpu_s"] = round(time.process_time() - cpu, 3)
        out["ticks"] = ticks
        out["to last publish s"] = round(last - burst, 3)
        out["published"] = client.llen("celery") - queued
        out["per s"] = round(out["published"] / max(last - burst, 1e-6))
        sched.close()
    return out


def _count_once(client: redis.Redis, n: int) -> dict[str, int]:
    """How many of the ``n`` entries' burst slots the queue holds once, and how many more than once."""
    seen: dict[str, int] = {}
    for raw in client.lrange("celery", 0, -1):
        name = json.loads(raw)["headers"].get("safe_time_entry")
        seen[name] = seen.get(name, 0) + 1
    return {
        "once": sum(1 for c in seen.values() if c == 1),
        "twice or more": sum(1 for c in seen.values() if c > 1),
        "missing": n - len(seen),
    }


#: the burst's runs (``--burst-modes``): one leader batched, unbatched, on PostgreSQL; three sharded beats
BURST_MODES = ("batched", "unbatched", "postgres", "sharded")
#: runs only when asked for: three sharded beats on PostgreSQL coordination
BURST_MODES_ASKED = ("sharded-postgres",)


def bench_burst(
    redis_url: str, n: int, postgres_url: str | None = None, modes: tuple[str, ...] = BURST_MODES
) -> dict[str, Any]:
    """The burst batched and one round trip per slot on Redis coordination, batched on PostgreSQL
    coordination when ``postgres_url`` is given (a fresh database: nothing else under its prefix), and
    fired by three beats sharing six shards (``benchmarks/beat_shards.py``)."""
    from benchmarks.beat_shards import SHARDED_POSTGRES_PREFIX, bench_sharded
    from celery_safe_time import save_entries
    from tests.helpers.beat import burst_hour

    client = redis.Redis.from_url(redis_url)
    out: dict[str, Any] = {"entries": n, "load average": os.getloadavg()[0]}
    for mode in modes:
        coordination = postgres_url if mode in ("postgres", "sharded-postgres") else None
        if mode in ("postgres", "sharded-postgres") and not postgres_url:
            continue
        # the sharded beats on PostgreSQL under a prefix of their own (the one leader's rows stay apart)
        prefix = SHARDED_POSTGRES_PREFIX if mode == "sharded-postgres" else "bench-burst:"
        client.flushdb()
        hour = burst_hour(time.time())
        save_entries(_burst_specs(n, hour), app=_app(redis_url, coordination, prefix))
        out[f"load average before {mode}"] = os.getloadavg()[0]
        if mode in ("sharded", "sharded-postgres"):
            out[mode] = bench_sharded(redis_url, n, hour, coordination)
        else:
            out[mode] = _child(redis_url, lazy=True, burst=(n, hour, mode == "unbatched"), coordination=coordination)
        if "error" not in out[mode]:
            out[mode].update(_count_once(client, n))
    client.flushdb()
    return out


def _reset_schedule(client: redis.Redis, prefix: str) -> None:
    """Drop the schedule state (not the definitions): the next leader is a fresh one."""
    keys = [f"{prefix}beat:{k}" for k in ("state", "due", "entries:applied", "lease", "entries:paused-until")]
    client.delete(*keys)
    for key in client.scan_iter(f"{prefix}beat:fired:*", count=10_000):
        client.delete(key)


def _reset_postgres(postgres_url: str) -> None:
    """:func:`_reset_schedule` on PostgreSQL coordination: the schedule state, the fired slots, the
    lease and the applied marker go (not the definitions)."""
    import sqlalchemy as sa

    from celery_safe_time.beat.backends import postgres as pg

    engine = sa.create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            for table in (pg.STATE_TABLE, pg.FIRED_TABLE, pg.LEASE_TABLE, pg.PAUSE_EXPIRY_TABLE):
                conn.execute(sa.text(f"DELETE FROM {table} WHERE ns = :ns"), {"ns": SCALE_PREFIX})
            conn.execute(sa.text(f"UPDATE {pg.META_TABLE} SET applied = NULL WHERE ns = :ns"), {"ns": SCALE_PREFIX})
    finally:
        engine.dispose()


def _drop_postgres(postgres_url: str) -> None:
    """Every row of the benchmark's namespace (the next size starts empty; the counts follow by trigger)."""
    import sqlalchemy as sa

    from celery_safe_time.beat.backends import postgres as pg

    tables = [getattr(pg, name) for name in dir(pg) if name.endswith("_TABLE") and not name.endswith("COUNTS_TABLE")]
    engine = sa.create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            for table in tables:
                conn.execute(sa.text(f"DELETE FROM {table} WHERE ns = :ns"), {"ns": SCALE_PREFIX})
    finally:
        engine.dispose()


def _vacuum(postgres_url: str) -> None:
    """VACUUM ANALYZE the beat tables after a bulk save, as autovacuum does soon after one (the
    planner's statistics and the visibility map, which a count by index-only scan needs)."""
    import sqlalchemy as sa

    engine = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("VACUUM ANALYZE"))
    finally:
        engine.dispose()


def _save_before(app: Any, specs: list[dict[str, Any]]) -> tuple[int, int]:
    """Entries stored per second (wall, caller's CPU) by ``save_entries`` as PostgreSQL stored a chunk
    before: the backend's ``entry_save`` per entry (a transaction each)."""
    from celery_safe_time import save_entries
    from celery_safe_time.beat.backends.base import BeatBackend
    from celery_safe_time.beat.backends.postgres import PostgresBeatBackend

    chunked = PostgresBeatBackend.entry_save_many
    PostgresBeatBackend.entry_save_many = BeatBackend.entry_save_many  # type: ignore[method-assign]
    try:
        started, cpu = time.perf_counter(), time.process_time()
        stored = save_entries(specs, app=app)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        PostgresBeatBackend.entry_save_many = chunked  # type: ignore[method-assign]
    return round(stored / seconds), round(stored / cpu)


def _child(
    redis_url: str, lazy: bool, burst: tuple[int, int, bool] | None = None, coordination: str | None = None
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "benchmarks.beat_scale", "--leader", redis_url]
    if not lazy:
        args.append("--load-all")
    if burst is not None:
        args += ["--burst", str(burst[0]), "--burst-hour", str(burst[1])] + (["--unbatched"] if burst[2] else [])
    if coordination:
        args += ["--coordination", coordination]
    done = subprocess.run(args, capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=3600, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bench_size(redis_url: str, n: int, baseline: bool, postgres_url: str | None = None) -> dict[str, Any]:
    from celery_safe_time import save_entries

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    app = _app(redis_url, postgres_url, SCALE_PREFIX)
    specs = _specs(n)
    # a quarter of them on PostgreSQL, where a single save takes several times as long here
    single = _save_one_at_a_time(app, specs[: min(n, SINGLE_SAVES // (4 if postgres_url else 1))])
    before: tuple[int, int] | None = None
    if postgres_url:
        _drop_postgres(postgres_url)
        before = _save_before(app, specs[: min(n, SAVE_BEFORE)])
        _drop_postgres(postgres_url)
    client.flushdb()
    started, cpu = time.perf_counter(), time.process_time()
    stored = save_entries(specs, app=app)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    out: dict[str, Any] = {
        "entries": n,
        "save_entries per s": round(stored / seconds),
        "save_entries per CPU s": round(stored / cpu),  # the caller's CPU (the wall rate is load-bound)
        "save_entries s": seconds,
        "save_entry per s": single[0],  # the baseline, one call per entry
        "save_entry per CPU s": single[1],
        "load average": os.getloadavg()[0],
    }
    if before is not None:
        out["save_entries before per s"], out["save_entries before per CPU s"] = before
    del specs
    if postgres_url:
        out["coordination"] = "postgres"
        _vacuum(postgres_url)
        out["reads only due"] = _child(redis_url, lazy=True, coordination=postgres_url)
        out["load average after"] = os.getloadavg()[0]
        _reset_postgres(postgres_url)
        out["state lost"] = _child(redis_url, lazy=True, coordination=postgres_url)
        _reset_postgres(postgres_url)
        out["loads all"] = _child(redis_url, lazy=False, coordination=postgres_url)
        _drop_postgres(postgres_url)
        client.flushdb()
        return out
    prefix = "safe_time:"
    out["redis MB"] = round(client.info("memory")["used_memory"] / 1e6, 1)
    out["reads only due"] = _child(redis_url, lazy=True)
    _reset_schedule(client, prefix)
    out["state lost"] = _child(redis_url, lazy=True)
    if baseline:
        _reset_schedule(client, prefix)
        out["loads all"] = _child(redis_url, lazy=False)
    client.flushdb()
    return out


def run_postgres(quick: bool, sizes: list[int] | None = None) -> dict[str, Any]:
    """The sizes on PostgreSQL coordination (a fresh database), each beside the leader that loads all."""
    claim = services.RedisDbClaim(services.resolve_redis_base())
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    results: dict[str, Any] = {"quick": quick, "coordination": "postgres"}
    try:
        postgres_url = db.url.replace("postgresql://", "postgresql+psycopg://", 1)
        for n in sizes or (SIZES_QUICK if quick else SIZES):
            results[str(n)] = bench_size(claim.url, n, baseline=True, postgres_url=postgres_url)
    finally:
        db.drop()
        redis.Redis.from_url(claim.url).flushdb()
        claim.release()
    return results


def run(
    quick: bool, sizes: list[int] | None = None, bursts: list[int] | None = None, modes: tuple[str, ...] = BURST_MODES
) -> dict[str, Any]:
    claim = services.RedisDbClaim(services.resolve_redis_base())
    results: dict[str, Any] = {"quick": quick}
    try:
        for n in [] if bursts and sizes is None else sizes or (SIZES_QUICK if quick else SIZES):
            # the load-all leader beside it up to 100,000 (at a million it takes half a minute and 2 GB)
            results[str(n)] = bench_size(claim.url, n, baseline=n <= 100_000)
        burst_sizes = bursts or (BURST_SIZES_QUICK if quick else BURST_SIZES)
        db = services.PostgresDatabase(services.resolve_postgres_admin_url())
        try:
            postgres_url = db.url.replace("postgresql://", "postgresql+psycopg://", 1)
            results["burst"] = {str(n): bench_burst(claim.url, n, postgres_url, modes) for n in burst_sizes}
        finally:
            db.drop()
    finally:
        redis.Redis.from_url(claim.url).flushdb()
        claim.release()
    return results


#: The program of a ``--save-only`` run, in a process of its own (it imports the tree on its path,
#: which may be a ``--baseline`` checkout): argv is the Redis URL, the entry count, the coordination
#: URL ("" for Redis); it prints the JSON of its rates.
SAVE_CHILD = """
import json, sys, time
from benchmarks.beat_scale import SCALE_PREFIX, _app, _specs
from celery_safe_time import save_entries

redis_url, n, coordination, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, float(sys.argv[4])
app = _app(redis_url, coordination, SCALE_PREFIX)
specs = _specs(n)
out = {}
taken = 0


def until_limit(started):
    global taken
    for taken, spec in enumerate(specs, 1):
        yield spec
        if time.perf_counter() - started > limit:
            return


for phase in ("first", "again") if n <= 100_000 else ("first",):
    started, cpu = time.perf_counter(), time.process_time()
    stored = save_entries(until_limit(started), app=app)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    out[phase] = {"stored": stored, "taken": taken, "s": round(seconds, 2), "per s": round(taken / seconds),
                  "per CPU s": round(taken / cpu)}
print(json.dumps(out))
"""


def _save_child(tree: Path, redis_url: str, n: int, coordination: str | None, limit: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [sys.executable, "-c", SAVE_CHILD, redis_url, str(n), coordination or "", str(limit)]
    done = subprocess.run(args, capture_output=True, text=True, cwd=str(tree), env=env, timeout=7200, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


#: ``--icu``: a PostgreSQL database whose collation is ICU's en-US (as many hosted databases'
#: en_US.UTF-8), beside the default one
ICU_DATABASE = "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"


def run_save(sizes: list[int], baseline: Path | None, limit: float = float("inf"), icu: bool = False) -> dict[str, Any]:
    """``save_entries`` alone at each size, on Redis and on PostgreSQL coordination (a fresh database
    per run; with ``icu`` also one whose collation is ICU's en-US), by this tree and, beside it in the
    same run, by ``baseline``; a run that has taken ``limit`` seconds is given no more entries (its
    rate is of those it took)."""
    claim = services.RedisDbClaim(services.resolve_redis_base())
    client = redis.Redis.from_url(claim.url)
    trees = {"this": ROOT, **({"baseline": baseline} if baseline else {})}
    results: dict[str, Any] = {"save only": True}
    try:
        for n in sizes:
            for backend in ("redis", "postgres", *(("postgres-icu",) if icu else ())):
                for label, tree in trees.items():
                    client.flushdb(asynchronous=True)
                    db = (
                        services.PostgresDatabase(
                            services.resolve_postgres_admin_url(), ICU_DATABASE if backend == "postgres-icu" else ""
                        )
                        if backend.startswith("postgres")
                        else None
                    )
                    try:
                        url = db.url.replace("postgresql://", "postgresql+psycopg://", 1) if db else None
                        load = os.getloadavg()[0]
                        measured = _save_child(tree, claim.url, n, url, limit)
                    finally:
                        if db is not None:
                            db.drop()
                    results[f"{n} {backend} {label}"] = {**measured, "load average": load}
                    print(f"{n} {backend} {label}: {measured}", file=sys.stderr, flush=True)
    finally:
        client.flushdb(asynchronous=True)
        claim.release()
    return results


def save_markdown(results: dict[str, Any]) -> str:
    header = (
        "entries", "coordination", "code", "save_entries (entries/s, wall / per CPU s)",
        "re-import, nothing changed (same)", "load average",
    )  # fmt: skip
    rows: list[tuple[object, ...]] = []
    for key, r in results.items():
        if not isinstance(r, dict):
            continue
        n, backend, label = key.split(" ")
        if "error" in r:
            rows.append((f"{int(n):,}", backend, label, "error", "", ""))
            continue
        first, again = r["first"], r.get("again")
        if first.get("taken", int(n)) < int(n):
            label += f" (stopped at {first['taken']:,} after {first['s']} s)"
        reimport = "" if again is None else f"{again['per s']:,} / {again['per CPU s']:,}"
        rows.append(
            (f"{int(n):,}", backend, label, f"{first['per s']:,} / {first['per CPU s']:,}", reimport,
             f"{r['load average']:.1f}")
        )  # fmt: skip
    return md_table(header, rows, "rllrrr")


def _measured(
    n: int, r: dict[str, Any], fields: tuple[tuple[str, str], ...], rows: list[tuple[object, ...]], columns: int
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(row label, field, measurement) of the fields ``r`` holds; a failed one is an error row in ``rows``."""
    for label, field in fields:
        m = r.get(field)
        if not m:
            continue
        if "error" in m:
            rows.append((f"{n:,}", label, "error", *[""] * (columns - 3)))
            continue
        yield label, field, m


#: the leaders each size is measured with: (row label, the field of its measurements)
_LEADERS = (
    ("reads only due (after save_entries)", "reads only due"),
    ("reads only due, state lost", "state lost"),
    ("loads all (before)", "loads all"),
)


def postgres_markdown(results: dict[str, Any]) -> str:
    """The sizes on PostgreSQL coordination: both leaders, their steady ticks, and save_entries before/after."""
    header = (
        "entries", "leader", "fresh leader's first slot (s)", "its plan complete, wall / CPU (s)",
        "takeover's first tick, wall / CPU (s)", "its first slot (s)", "steady tick p50 / p99 (ms)",
        "beat RSS growth (MB)", "save_entries (entries/s, wall / per CPU s)",
    )  # fmt: skip
    rows: list[tuple[object, ...]] = []
    for n, r in by_size(results):
        for label, field, m in _measured(n, r, _LEADERS, rows, len(header)):
            fp, t, st = m.get("fresh plan complete", {}), m["takeover"], m.get("steady tick", {})
            rate = (
                f"{r['save_entries per s']:,} / {r['save_entries per CPU s']:,}"
                if field == "reads only due"
                else f"{r.get('save_entries before per s', 0):,} / {r.get('save_entries before per CPU s', 0):,}"
            )
            rows.append(
                (f"{n:,}", label, m.get("fresh first slot s"), f"{fp.get('s')} / {fp.get('cpu_s')}",
                 f"{t['s']} / {t['cpu_s']}", m.get("takeover first slot s"),
                 f"{st.get('p50_ms')} / {st.get('p99_ms')}", f"+{m['rss after takeover MB']}", rate)
            )  # fmt: skip
    return md_table(header, rows, "rl" + "r" * (len(header) - 2))


def markdown(results: dict[str, Any]) -> str:
    if results.get("save only"):
        return save_markdown(results)
    if results.get("coordination") == "postgres":
        return postgres_markdown(results)
    header = (
        "entries", "leader", "fresh leader's first tick, wall / CPU (s)", "its first slot (s)",
        "its plan complete, wall / CPU (s)", "takeover's first tick, wall / CPU (s)", "its first slot (s)",
        "beat RSS growth (MB)", "save_entries (entries/s, wall / per CPU s)", "save_entry one at a time (same)",
    )  # fmt: skip
    rows: list[tuple[object, ...]] = []
    for n, r in by_size(results):
        for label, field, m in _measured(n, r, _LEADERS, rows, len(header)):
            f, t = m["fresh"], m["takeover"]
            fp = m.get("fresh plan complete", {})
            rate = single = ""
            if field == "reads only due":
                rate = f"{r['save_entries per s']:,} / {r.get('save_entries per CPU s', 0):,}"
                single = f"{r.get('save_entry per s', 0):,} / {r.get('save_entry per CPU s', 0):,}"
            rows.append(
                (f"{n:,}", label, f"{f['s']} / {f['cpu_s']}", m.get("fresh first slot s"),
                 f"{fp.get('s')} / {fp.get('cpu_s')}", f"{t['s']} / {t['cpu_s']}", m.get("takeover first slot s"),
                 f"+{m['rss after takeover MB']}", rate, single)
            )  # fmt: skip
    burst = burst_markdown(results.get("burst", {}))
    if not rows:  # only the burst was measured (--burst-only)
        return burst
    return md_table(header, rows, "rl" + "r" * (len(header) - 2)) + "\n\n" + burst


_BURST_ROWS = (
    ("a chunk per round trip", "batched"),
    ("one round trip per slot", "unbatched"),
    ("a chunk per round trip, PostgreSQL coordination", "postgres"),
    ("a chunk per round trip, 3 beats sharing 6 shards (`safe_time_beat_shards = 6`)", "sharded"),
    ("a chunk per round trip, 3 beats sharing 6 shards, PostgreSQL coordination", "sharded-postgres"),
)


def burst_markdown(bursts: dict[str, Any]) -> str:
    """The burst table: batched (this release) beside one publish round trip per slot."""
    header = (
        "entries due at once", "publishing", "burst to the last publish (s)", "slots/s", "beat CPU (s)",
        "published exactly once / twice or more / missing",
    )  # fmt: skip
    rows: list[tuple[object, ...]] = []
    for n, r in by_size(bursts):
        for label, _, m in _measured(n, r, _BURST_ROWS, rows, len(header)):
            rows.append(
                (f"{n:,}", label, m["to last publish s"], f"{m['per s']:,}", m["cpu_s"],
                 f"{m['once']:,} / {m['twice or more']} / {m['missing']}")
            )  # fmt: skip
    return md_table(header, rows, "rl" + "r" * (len(header) - 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default=None, help="Entry counts, comma-separated (default 10000,100000).")
    parser.add_argument("--leader", default=None, help=argparse.SUPPRESS)  # the child: a Redis URL
    parser.add_argument("--load-all", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--burst", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--burst-hour", type=int, default=9, help=argparse.SUPPRESS)
    parser.add_argument("--unbatched", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordination", default=None, help=argparse.SUPPRESS)  # the child: PostgreSQL URL
    parser.add_argument(
        "--postgres", action="store_true", help="Leaders on PostgreSQL coordination (no burst; the broker stays Redis)."
    )
    parser.add_argument("--burst-only", default=None, help="Only the burst, of these sizes (comma-separated).")
    parser.add_argument("--burst-modes", default=",".join(BURST_MODES), help="The burst's runs (comma-separated).")
    parser.add_argument("--shard-beat", type=int, default=None, help=argparse.SUPPRESS)  # the child: its index
    parser.add_argument("--save-only", action="store_true", help="Only save_entries, on Redis and PostgreSQL.")
    parser.add_argument("--baseline", default=None, help="With --save-only: also run the code in this checkout.")
    parser.add_argument(
        "--icu", action="store_true", help="With --save-only: also on a PostgreSQL database collated by ICU's en-US."
    )
    parser.add_argument(
        "--save-limit", type=float, default=float("inf"), help="With --save-only: seconds a run may take."
    )
    args = parser.parse_args(argv)
    if args.leader and args.burst and args.shard_beat is not None:
        from benchmarks.beat_shards import shard_child

        print(json.dumps(shard_child(args.leader, args.burst, args.burst_hour, args.shard_beat, args.coordination)))
        return 0
    if args.leader and args.burst:
        print(json.dumps(burst_child(args.leader, args.burst, args.burst_hour, args.unbatched, args.coordination)))
        return 0
    if args.leader:
        print(json.dumps(leader_child(args.leader, lazy=not args.load_all, coordination=args.coordination)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    if args.save_only:
        baseline = Path(args.baseline).resolve() if args.baseline else None
        saved = run_save(sizes or list(SIZES), baseline, args.save_limit, args.icu)
        return print_report(save_markdown(saved), saved)
    bursts = [int(s) for s in args.burst_only.split(",")] if args.burst_only else None
    modes = tuple(m for m in args.burst_modes.split(",") if m)
    unknown = set(modes) - set(BURST_MODES) - set(BURST_MODES_ASKED)
    if unknown:
        known = ", ".join((*BURST_MODES, *BURST_MODES_ASKED))
        parser.error(f"--burst-modes: unknown {', '.join(sorted(unknown))} (use {known})")
    results = run_postgres(args.quick, sizes) if args.postgres else run(args.quick, sizes, bursts, modes)
    return print_report(markdown(results), results)


if __name__ == "__main__":
    sys.exit(main())
