"""Beat at SaaS size: one Redis leader with 10,000 and 100,000 runtime entries (1,000,000 with
``--sizes``), 10 every second and the rest daily at 09:00 in their tenant's timezone.

Per size, in the same run and on the same stored entries:

- ``save_entries``: entries stored per second (validated, a chunk per round trip), beside
  ``save_entry`` one at a time (the baseline: 2,000 of them, in the same run);
- a fresh leader's first tick (no schedule state in Redis: it plans every entry, a chunk per tick,
  firing what is due in between), how long after taking the lease it published its first slot and
  finished its plan; a takeover's first tick (the previous leader's state and marker in Redis) and
  first slot; wall and CPU seconds, and the growth of the beat process's RSS over both;
- each measured twice: a leader that reads only what is due (this release, from
  ``BEAT_LAZY_ENTRIES`` runtime entries on) and one that loads every entry (``lazy_threshold``
  raised past the count: what every leader did before), each in a process of its own so RSS is its own.

``python -m benchmarks.beat_scale [--quick] [--sizes 10000,100000,1000000]``; needs the local Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from tests.helpers import services

SIZES = (10_000, 100_000)
SIZES_QUICK = (10_000,)
BUSY = 10
#: how many entries ``save_entry`` saves one at a time (the baseline of ``save_entries``)
SINGLE_SAVES = 2000
_ZONES = ("Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "UTC")
ROOT = Path(__file__).resolve().parents[1]


def _app(redis_url: str) -> Any:
    from celery import Celery

    app = Celery("bench", set_as_current=False)
    app.conf.update(
        broker_url=redis_url, timezone="UTC", beat_max_loop_interval=1, safe_time_beat_lease=6, beat_schedule={}
    )

    @app.task(name="bench.noop")
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


def leader_child(redis_url: str, lazy: bool) -> dict[str, Any]:
    """In a process of its own: a fresh leader's first tick, then a takeover's, and the RSS growth."""
    from celery_safe_time import signals
    from celery_safe_time.beat.scheduler import SafeScheduler

    app = _app(redis_url)
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
            out[f"rss after {phase} MB"] = round(_rss_mb() - start_rss, 1)
            sched.close()
    return out


def _reset_schedule(client: redis.Redis, prefix: str) -> None:
    """Drop the schedule state (not the definitions): the next leader is a fresh one."""
    keys = [f"{prefix}beat:{k}" for k in ("state", "due", "entries:applied", "lease", "entries:paused-until")]
    client.delete(*keys)
    for key in client.scan_iter(f"{prefix}beat:fired:*", count=10_000):
        client.delete(key)


def _child(redis_url: str, lazy: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "benchmarks.beat_scale", "--leader", redis_url]
    if not lazy:
        args.append("--load-all")
    done = subprocess.run(args, capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=3600, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bench_size(redis_url: str, n: int, baseline: bool) -> dict[str, Any]:
    from celery_safe_time import save_entries

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    app = _app(redis_url)
    specs = _specs(n)
    single = _save_one_at_a_time(app, specs[: min(n, SINGLE_SAVES)])
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
    del specs
    prefix = "safe_time:"
    out["redis MB"] = round(client.info("memory")["used_memory"] / 1e6, 1)
    out["reads only due"] = _child(redis_url, lazy=True)
    if baseline:
        _reset_schedule(client, prefix)
        out["loads all"] = _child(redis_url, lazy=False)
    client.flushdb()
    return out


def run(quick: bool, sizes: list[int] | None = None) -> dict[str, Any]:
    claim = services.RedisDbClaim(services.resolve_redis_base())
    results: dict[str, Any] = {"quick": quick}
    try:
        for n in sizes or (SIZES_QUICK if quick else SIZES):
            # the load-all leader beside it up to 100,000 (at a million it takes half a minute and 2 GB)
            results[str(n)] = bench_size(claim.url, n, baseline=n <= 100_000)
    finally:
        redis.Redis.from_url(claim.url).flushdb()
        claim.release()
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| entries | leader | fresh leader's first tick, wall / CPU (s) | its first slot (s) | its plan complete, "
        "wall / CPU (s) | takeover's first tick, wall / CPU (s) | its first slot (s) | beat RSS growth (MB) "
        "| save_entries (entries/s, wall / per CPU s) | save_entry one at a time (same) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in results.items():
        if not key.isdigit():
            continue
        for label, field in (("reads only due", "reads only due"), ("loads all (before)", "loads all")):
            m = r.get(field)
            if not m:
                continue
            if "error" in m:
                lines.append(f"| {int(key):,} | {label} | error | | | | | | | |")
                continue
            f, t = m["fresh"], m["takeover"]
            fp = m.get("fresh plan complete", {})
            rate = single = ""
            if field == "reads only due":
                rate = f"{r['save_entries per s']:,} / {r.get('save_entries per CPU s', 0):,}"
                single = f"{r.get('save_entry per s', 0):,} / {r.get('save_entry per CPU s', 0):,}"
            lines.append(
                f"| {int(key):,} | {label} | {f['s']} / {f['cpu_s']} | {m.get('fresh first slot s')} "
                f"| {fp.get('s')} / {fp.get('cpu_s')} | {t['s']} / {t['cpu_s']} | {m.get('takeover first slot s')} "
                f"| +{m['rss after takeover MB']} | {rate} | {single} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default=None, help="Entry counts, comma-separated (default 10000,100000).")
    parser.add_argument("--leader", default=None, help=argparse.SUPPRESS)  # the child: a Redis URL
    parser.add_argument("--load-all", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.leader:
        print(json.dumps(leader_child(args.leader, lazy=not args.load_all)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    results = run(args.quick, sizes)
    print(markdown(results))
    print()
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
