"""Overlap-lock overhead and throughput, side by side with the same bare task.

``python -m benchmarks.locks [--quick]`` prints a markdown table; ``run(quick) -> dict`` returns
the numbers. Everything runs against a private ``redis-server`` (broker and locks) and one
prefork worker (concurrency 4):

- overhead: bare, ``overlap_lock`` and ``idempotent`` tasks with distinct keys, interleaved on
  the same worker in the same run (each round in a shuffled order: no kind keeps one position);
  each is timed inside the worker from ``task_prerun`` to ``task_postrun``, so broker latency is
  left out and what differs is the decorator. Beside them, tasks that make one and two Redis round
  trips (PING) on the lock client: the floor of a lock (acquire, release). Measured twice in the
  same run: with Redis as the broker, and with RabbitMQ (a vhost of its own on the local server;
  locks still on the private redis-server).
- throughput: N short tasks under ``overlap_lock`` over 100 keys (conflicts re-queue after
  50 ms) vs N bare tasks, published while the worker is paused, timed from the first start to
  the last finish.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

from benchmarks.common import PrivateRedis

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 4


class _Services:
    """A private redis-server (locks, timings and, unless ``amqp_url``, the broker) and one worker."""

    def __init__(self, amqp_url: str | None = None, pg_url: str = "") -> None:
        self.redis = PrivateRedis("locks")
        self.dir, self.redis_url, self.client = self.redis.dir, self.redis.url, self.redis.client
        #: The broker: the redis-server, or a RabbitMQ vhost.
        self.url = amqp_url or self.redis_url
        self.worker: subprocess.Popen[bytes] | None = None
        self.log = Path(self.dir) / "worker.log"
        #: The PostgreSQL coordination database of the backend rows ("" : not measured).
        self.pg_url = pg_url
        self.kinds = KINDS + (PG_KINDS if pg_url else ())

    def start_worker(self) -> None:
        env = {
            **os.environ,
            "SAFE_TIME_BENCH_BROKER_URL": self.url,
            "SAFE_TIME_BENCH_REDIS_URL": self.redis_url,
            "SAFE_TIME_BENCH_PG_URL": self.pg_url,
            "PYTHONPATH": str(ROOT),
        }
        with open(self.log, "ab") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "benchmarks.locks_app", "worker", "-l", "WARNING",
                 "-c", str(CONCURRENCY), "-P", "prefork", "--without-gossip", "--without-mingle",
                 "--without-heartbeat"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir,
            )  # fmt: skip
        app = Celery("bench-client", broker=self.url, set_as_current=False)
        deadline = time.monotonic() + 60
        while not app.control.ping(timeout=0.5):
            if time.monotonic() > deadline:
                raise RuntimeError("benchmark worker did not start:\n" + self.log.read_text()[-3000:])
        app.close()

    def signal_worker(self, sig: int) -> None:
        if self.worker is not None:
            os.killpg(self.worker.pid, sig)

    def close(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.signal_worker(signal.SIGCONT)
            self.signal_worker(signal.SIGTERM)
            try:
                self.worker.wait(20)
            except subprocess.TimeoutExpired:
                self.signal_worker(signal.SIGKILL)
                self.worker.wait(10)
        self.redis.close()


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmark timed out waiting for {what}")
        time.sleep(0.05)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


KINDS = (
    "bench.bare",
    "bench.locked",
    "bench.locked_before",
    "bench.locked_waiting",
    "bench.locked_memory",
    "bench.idempotent",
    "bench.idempotent_waiting",
    "bench.ping",
    "bench.ping2",
    "bench.ping2_lean",
    "bench.scripts",
    "bench.scripts_redispy",
)
#: acquire + release on PostgreSQL (lease rows, session advisory locks) and two SELECT 1 (their floor).
PG_KINDS = ("bench.pg_lease", "bench.pg_lease_noflush", "bench.pg_session", "bench.pg_select2")


def _overhead(services: _Services, app: Celery, per_kind: int) -> dict[str, Any]:
    kinds = services.kinds
    # Each round sends every kind once, in an order of its own: with one fixed order the kind sent
    # right after the bare task ran 5-8% slower than the same kind sent later (measured by swapping
    # overlap_lock and idempotent), a bias that fell on whichever row stood first.
    order = random.Random(per_kind)
    for n in range(per_kind):
        for kind in order.sample(kinds, len(kinds)):
            app.send_task(kind, args=(n,))
    _wait(
        lambda: all(services.client.llen(f"bench:durations:{k}") >= per_kind for k in kinds),
        600,
        "overhead tasks",
    )
    ms = {k: [float(v) * 1000 for v in services.client.lrange(f"bench:durations:{k}", 0, -1)] for k in kinds}
    bare = ms["bench.bare"]
    result: dict[str, Any] = {"tasks_per_kind": per_kind}
    for kind in kinds:
        short = kind.split(".", 1)[1]
        result[short] = {
            "median_ms": statistics.median(ms[kind]),
            "p99_ms": _percentile(ms[kind], 0.99),
            "median_added_ms": statistics.median(ms[kind]) - statistics.median(bare),
            "p99_added_ms": _percentile(ms[kind], 0.99) - _percentile(bare, 0.99),
        }
    two_trips = result["ping2"]["median_added_ms"]
    two_lean = result["ping2_lean"]["median_added_ms"]
    for short in (
        "locked",
        "locked_before",
        "locked_waiting",
        "idempotent",
        "idempotent_waiting",
        "scripts",
        "scripts_redispy",
    ):
        # The goal: within 1.1x of two Redis round trips (acquire, release) measured beside it.
        result[short]["vs_two_round_trips"] = result[short]["median_added_ms"] / two_trips if two_trips > 0 else None
        # The stricter floor: two round trips sent the lean way the scripts are.
        result[short]["vs_two_lean_round_trips"] = result[short]["median_added_ms"] / two_lean if two_lean > 0 else None
    if "pg_lease" in result:
        redis_lock = result["scripts"]["median_added_ms"]
        floor = result["pg_select2"]["median_added_ms"]
        for short in ("pg_lease", "pg_lease_noflush", "pg_session"):
            added = result[short]["median_added_ms"]
            # The goal: a PostgreSQL lock within 2x of the Redis one, measured beside it.
            result[short]["vs_redis"] = added / redis_lock if redis_lock > 0 else None
            # ... and of the Redis lock as it was when that goal was set (redis-py's command path).
            redispy = result["scripts_redispy"]["median_added_ms"]
            result[short]["vs_redis_redispy"] = added / redispy if redispy > 0 else None
            result[short]["vs_two_round_trips"] = added / floor if floor > 0 else None
    return result


def _measure_overhead(services: _Services, per_kind: int) -> dict[str, Any]:
    app = Celery("bench-client", broker=services.url, set_as_current=False)
    try:
        services.start_worker()
        # warm up: imports, connections and script loading happen once per pool child
        for n in range(4 * CONCURRENCY):
            for kind in services.kinds:
                app.send_task(kind, args=(-1 - n,))
        _wait(
            lambda: all(services.client.llen(f"bench:durations:{k}") >= 4 * CONCURRENCY for k in services.kinds),
            120,
            "warm-up",
        )
        services.client.delete(*[f"bench:durations:{k}" for k in services.kinds])
        return _overhead(services, app, per_kind)
    finally:
        app.close()


def _throughput(services: _Services, app: Celery, name: str, count: int) -> dict[str, float]:
    services.signal_worker(signal.SIGSTOP)
    try:
        with app.producer_or_acquire() as producer:
            for n in range(count):
                app.send_task(name, args=(n,), producer=producer)
    finally:
        services.signal_worker(signal.SIGCONT)
    _wait(lambda: int(services.client.get(f"bench:done:{name}") or 0) >= count, 900, f"{count} {name}")
    first = float(services.client.get(f"bench:first:{name}") or 0)
    last = float(services.client.get(f"bench:last:{name}") or 0)
    seconds = max(last - first, 1e-9)
    return {"tasks": count, "seconds": seconds, "tasks_per_second": count / seconds}


def _rabbit_vhost() -> tuple[Any, str]:
    """A vhost of its own on the local RabbitMQ, or None and why not."""
    from tests.helpers import services

    try:
        return services.RabbitVhost(services.resolve_amqp_base()).create(), ""
    except BaseException as exc:  # services.unavailable() raises pytest's skip/fail outcomes
        return None, str(exc) or exc.__class__.__name__


def _postgres_database() -> tuple[Any, str]:
    """A fresh PostgreSQL database for the backend rows, or None and why not."""
    from tests.helpers import services

    try:
        return services.PostgresDatabase(services.resolve_postgres_admin_url()), ""
    except BaseException as exc:  # services.unavailable() raises pytest's skip/fail outcomes
        return None, str(exc) or exc.__class__.__name__


def _takeover(kind: str, url: str, ttl: float, repeats: int) -> dict[str, Any]:
    """kill -9 a process holding a lock (renewing it every ttl/3, as the watchdog does) right after it
    took it; time from the kill until this process can take the lock (polled every 10 ms)."""
    from benchmarks.locks_holder import store_for
    from celery_safe_time.locks.backends import Owner

    store = store_for(kind, url)
    owner = Owner(task_id="bench-taker", identity="bench-taker:0:0", host="bench", pid=os.getpid())
    waits: list[float] = []
    for n in range(repeats):
        key = f"takeover:{kind}:{n}:{time.time_ns()}"
        holder = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.locks_holder", kind, url, key, str(ttl)],
            stdout=subprocess.PIPE, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert holder.stdout is not None
        line = holder.stdout.readline().decode().strip()
        if line != "held":
            holder.kill()
            raise RuntimeError(f"lock holder for {kind} said {line!r}")
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        holder.wait(10)
        while True:
            token = f"taker-{n}"
            if store.acquire(key, token, ttl, owner).status == "acquired":
                waits.append(time.monotonic() - killed)
                store.release(key, token)
                break
            if time.monotonic() - killed > ttl * 3 + 10:
                raise RuntimeError(f"{kind}: lock of a killed holder never freed")
            time.sleep(0.01)
    store.close()
    return {"ttl": ttl, "repeats": repeats, "median_s": statistics.median(waits), "max_s": max(waits)}


def run(quick: bool = False) -> dict[str, Any]:
    """Measure and return the numbers (quick: smoke sizes, a run that checks every phase runs end to end)."""
    per_kind = 50 if quick else 2000
    tp_count = 200 if quick else 10000
    pg, pg_missing = _postgres_database()
    pg_url = pg.url.replace("postgresql://", "postgresql+psycopg://", 1) if pg is not None else ""
    services = _Services(pg_url=pg_url)
    app = Celery("bench-client", broker=services.url, set_as_current=False)
    takeover: dict[str, Any] = {}
    try:
        overhead = _measure_overhead(services, per_kind)
        bare_tp = _throughput(services, app, "bench.tp_bare", tp_count)
        locked_tp = _throughput(services, app, "bench.tp_locked", tp_count)
        waiting_tp = _throughput(services, app, "bench.tp_locked_waiting", tp_count)
        ttl, repeats = (2.0, 1) if quick else (5.0, 5)
        targets = [("redis", services.redis_url)] + ([("lease", pg_url), ("session", pg_url)] if pg_url else [])
        for kind, url in targets:
            takeover[kind] = _takeover(kind, url, ttl, repeats)
    finally:
        app.close()
        services.close()
        if pg is not None:
            from celery_safe_time.coordination import dispose_engines

            dispose_engines()
            pg.drop()
    vhost, missing = _rabbit_vhost()
    overhead_amqp: dict[str, Any] = {"missing": missing}
    if vhost is not None:
        on_rabbit = _Services(amqp_url=vhost.url)
        try:
            overhead_amqp = _measure_overhead(on_rabbit, per_kind)
        finally:
            on_rabbit.close()
            vhost.delete()
    return {
        "quick": quick,
        "concurrency": CONCURRENCY,
        "overhead": overhead,
        "overhead_amqp": overhead_amqp,
        "postgres_missing": pg_missing,
        "takeover": takeover,
        "throughput": {
            "keys": 100,
            "bare": bare_tp,
            "locked": locked_tp,
            "locked_vs_bare": locked_tp["tasks_per_second"] / bare_tp["tasks_per_second"],
            "locked_waiting": waiting_tp,
            "locked_waiting_vs_bare": waiting_tp["tasks_per_second"] / bare_tp["tasks_per_second"],
        },
    }


def _overhead_table(o: dict[str, Any]) -> list[str]:
    lines = [
        "| task | median ms | p99 ms | median added ms | p99 added ms | added / two PINGs | added / two lean PINGs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {
        "bare": "bare",
        "locked": "overlap_lock",
        "locked_before": "overlap_lock, renewer woken on every acquire (before)",
        "locked_waiting": "overlap_lock, waiting for the release's answer (before)",
        "locked_memory": "overlap_lock on the in-process store (the decorator's Python, no Redis)",
        "idempotent": "idempotent",
        "idempotent_waiting": "idempotent, waiting for the commit's answer (before)",
        "ping": "bare + one Redis PING",
        "ping2": "bare + two Redis PINGs",
        "ping2_lean": "bare + two Redis PINGs sent the lean way (kept connection, no redis-py command path)",
        "scripts": "bare + the lock's two scripts, called directly",
        "scripts_redispy": "bare + the same two scripts through redis-py's Script (the path before)",
    }
    for kind, label in labels.items():
        row = o.get(kind)
        if row is None:  # saved by a run from before this row existed
            continue
        versus, lean = row.get("vs_two_round_trips"), row.get("vs_two_lean_round_trips")
        lines.append(
            f"| {label} | {row['median_ms']:.3f} | {row['p99_ms']:.3f} | "
            f"{row['median_added_ms']:+.3f} | {row['p99_added_ms']:+.3f} | "
            f"{'-' if versus is None else f'{versus:.2f}x'} | {'-' if lean is None else f'{lean:.2f}x'} |"
        )
    return lines


def _backends_table(result: dict[str, Any]) -> list[str]:
    o, takeover = result["overhead"], result.get("takeover") or {}
    if "pg_lease" not in o:
        return ["", f"PostgreSQL lock backend: not measured ({result.get('postgres_missing') or 'no database'})."]
    lines = [
        "",
        "Lock backends side by side, same worker, same run: acquire + release called directly (the two calls "
        "overlap_lock makes), added to a bare task; after kill -9 of a holder (renewing every ttl/3), the time "
        "until another process takes the lock:",
        "",
        "| backend | median added ms | p99 added ms | vs Redis | vs its two round trips "
        "| kill -9 -> free (median / max s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = (
        ("Redis (Lua scripts)", o["scripts"], None, o["scripts"].get("vs_two_round_trips"), takeover.get("redis")),
        ("PostgreSQL lease rows (default)", o["pg_lease"], o["pg_lease"].get("vs_redis"),
         o["pg_lease"].get("vs_two_round_trips"), takeover.get("lease")),
        ("PostgreSQL lease rows, `synchronous_commit=off` in the URL (no flush per acquire)",
         o.get("pg_lease_noflush") or o["pg_lease"], (o.get("pg_lease_noflush") or {}).get("vs_redis"),
         (o.get("pg_lease_noflush") or {}).get("vs_two_round_trips"), None),
        ("PostgreSQL session advisory locks", o["pg_session"], o["pg_session"].get("vs_redis"),
         o["pg_session"].get("vs_two_round_trips"), takeover.get("session")),
    )  # fmt: skip
    for label, row, vs_redis, vs_trips, free in rows:
        freed = f"{free['median_s']:.2f} / {free['max_s']:.2f} (ttl {free['ttl']:g})" if free else "-"
        lines.append(
            f"| {label} | {row['median_added_ms']:+.3f} | {row['p99_added_ms']:+.3f} | "
            f"{'1.00x' if vs_redis is None else f'{vs_redis:.2f}x'} | "
            f"{'-' if vs_trips is None else f'{vs_trips:.2f}x'} | {freed} |"
        )
    floor = o["pg_select2"]
    lines += [
        "",
        "Two `SELECT 1` round trips on DBAPI connections of the lock engine's pool, as the lock calls run "
        "(the PostgreSQL floor): "
        f"+{floor['median_added_ms']:.3f} ms.",
    ]
    return lines


def markdown(result: dict[str, Any]) -> str:
    o, t = result["overhead"], result["throughput"]
    lines = [
        f"Per-task time inside the worker (prefork, concurrency {result['concurrency']}, "
        f"{o['tasks_per_kind']} tasks each, interleaved):",
        "",
        *_overhead_table(o),
    ]
    oa = result.get("overhead_amqp") or {}
    if "missing" in oa:
        lines += ["", f"With RabbitMQ as the broker: not measured ({oa['missing']})."]
    else:
        lines += ["", "The same with RabbitMQ as the broker (locks on the same private redis-server), same run:", ""]
        lines += _overhead_table(oa)
    lines += [
        "",
        "A lock makes two Redis calls (acquire, release); the PING rows are one and two round trips on the "
        "same worker, the goal is overlap_lock within 1.1x of two. The lock's scripts go the lean way "
        "(`celery_safe_time/locks/redis_wire.py`: a kept connection, no redis-py command path); the last column "
        "compares with two PINGs sent that way too, the floor of two round trips from Python. A delivered "
        "task writes its release (or commit) without waiting for the answer, which is read after the task, "
        "in Celery's task_postrun, before the delivery is acknowledged (inside the measured time: the "
        "timing receiver runs after it); the 'waiting for the answer (before)' rows wait in the body, as "
        "every lock did before; the 'scripts, called directly' row waits for both answers.",
        *_backends_table(result),
        "",
        f"Throughput, {t['bare']['tasks']} short tasks (locked: {t['keys']} keys, conflicts re-queued after 50 ms):",
        "",
        "| task | seconds | tasks/s |",
        "|---|---:|---:|",
        f"| bare | {t['bare']['seconds']:.2f} | {t['bare']['tasks_per_second']:.0f} |",
        f"| overlap_lock | {t['locked']['seconds']:.2f} | {t['locked']['tasks_per_second']:.0f} |",
        *(
            [
                f"| overlap_lock, waiting for the release's answer (before) | {t['locked_waiting']['seconds']:.2f} | "
                f"{t['locked_waiting']['tasks_per_second']:.0f} |"
            ]
            if "locked_waiting" in t
            else []
        ),
        "",
        f"Locked throughput is {t['locked_vs_bare']:.0%} of bare"
        + (f" ({t['locked_waiting_vs_bare']:.0%} waiting for the answer)." if "locked_waiting" in t else "."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke run)")
    args = parser.parse_args(argv)
    print(markdown(run(quick=args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
