"""Safe Beat benchmarks, side by side with the schedulers people use today.

- failover seconds after ``kill -9`` of the leader: SafeScheduler (default 30 s lease) vs
  celery-redbeat with its defaults (lock timeout 5 x max_interval = 1500 s), in the same run;
- tick p50/p99 with 10,000 entries: SafeScheduler vs PersistentScheduler;
- the guard's extra cost per published slot (one Redis round trip);
- SafeDatabaseScheduler vs django-celery-beat's DatabaseScheduler with 10,000 periodic tasks:
  time to first tick and tick p99;
- runtime entries (``save_entry``), 100,000 of them (quick: 5,000), against celery-redbeat's entry API
  (``RedBeatSchedulerEntry.save``) with the same entries: tick p99, the time from a save to the
  leader's first fire of it, Redis memory per entry; their tick sampled interleaved with a second
  SafeScheduler holding 10,000 static (beat_schedule) entries, so both see the same machine; the first
  tick of a leader that finds no state (fresh) and of one taking over (state in Redis), wall and CPU.

Needs the local Redis and PostgreSQL of the test suite. ``python -m benchmarks.beat [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import print_report
from celery_safe_time.redis_client import as_text, load_script
from tests.helpers import services
from tests.helpers.processes import CeleryProcess

N_ENTRIES = 10_000
N_RUNTIME = 100_000
N_RUNTIME_QUICK = 5_000


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(_pct(values, 0.5) * 1000, 3),
        "p99_ms": round(_pct(values, 0.99) * 1000, 3),
        "samples_ms": [round(v * 1000, 3) for v in values],  # for the doc's distribution chart
    }


# --- failover ---------------------------------------------------------------------
_SENT = re.compile(r"[Ss]ending due task")


def _sent(proc: CeleryProcess) -> int:
    return len(_SENT.findall(proc.log()))


def _failover(
    scheduler: str, redis_url: str, log_dir: Path, cap: float, extra: dict[str, Any], name: str | None = None
) -> dict[str, Any]:
    """Start two beats with default settings, kill -9 the one sending, time the other's first send.
    ``name``: the beats' log names (races run side by side need their own)."""
    env = {
        "SAFE_TIME_TEST_BROKER_URL": redis_url,
        "SAFE_TIME_TEST_BEAT_SCHEDULE": json.dumps({"fast": {"task": "tests.record", "every": 1, "args": ["f"]}}),
        # undo the test suite's 1 s max interval: these are the schedulers' defaults
        "SAFE_TIME_TEST_APP_CONF": json.dumps({"beat_max_loop_interval": 0, **extra}),
    }
    beats = []
    for i in range(2):
        label = name or scheduler.split(".")[0]
        args = ["beat", "-l", "INFO", "-S", scheduler, "-s", str(log_dir / f"{name or scheduler}-{i}")]
        beats.append(CeleryProcess("tests.apps.beat_app", args, env, log_dir, f"{label}-{i}").start())
    try:
        deadline = time.monotonic() + 60
        leader = None
        while time.monotonic() < deadline and leader is None:
            time.sleep(0.5)
            leader = next((b for b in beats if _sent(b) >= 2), None)
        if leader is None:
            return {"failover_s": None, "note": "no beat started sending within 60 s"}
        other = next(b for b in beats if b is not leader)
        before = _sent(other)
        leader.kill()
        killed = time.monotonic()
        while time.monotonic() - killed < cap:
            if _sent(other) > before:
                return {"failover_s": round(time.monotonic() - killed, 1)}
            time.sleep(0.2)
        return {"failover_s": None, "note": f"no takeover within {cap:g} s (measurement cap)"}
    finally:
        for b in beats:
            if b.alive():
                b.kill()


def bench_failover(redis_url: str, quick: bool, postgres_url: str | None = None) -> dict[str, Any]:
    import threading

    results: dict[str, Any] = {}
    cap = 42.0 if quick else 60.0  # redbeat's lock timeout is 1500 s: the cap is what we can afford
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {
            "SafeScheduler (lease 30 s)": ("celery_safe_time.SafeScheduler", {}),
            "celery-redbeat (defaults)": ("redbeat.RedBeatScheduler", {"redbeat_redis_url": redis_url}),
        }
        names = {"SafeScheduler on PostgreSQL (lease 30 s)": "safe-postgres"}
        if postgres_url:  # the same race with the lease in PostgreSQL, run beside the Redis one
            jobs["SafeScheduler on PostgreSQL (lease 30 s)"] = (
                "celery_safe_time.SafeScheduler",
                {"safe_time_coordination_url": postgres_url, "safe_time_key_prefix": "bench-failover:"},
            )
        threads = []
        for label, (sched, extra) in jobs.items():

            def run(label: str = label, sched: str = sched, extra: dict[str, Any] = extra) -> None:
                results[label] = _failover(sched, redis_url, Path(tmp), cap, extra, names.get(label))

            threads.append(threading.Thread(target=run))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    results["celery-redbeat (defaults)"]["bound_s"] = 5 * 300  # lock timeout = 5 x default max_interval
    results["SafeScheduler (lease 30 s)"]["bound_s"] = 30 + 10
    if "SafeScheduler on PostgreSQL (lease 30 s)" in results:
        results["SafeScheduler on PostgreSQL (lease 30 s)"]["bound_s"] = 30 + 10
    return results


# --- tick cost ----------------------------------------------------------------------
def _app(redis_url: str, **conf: Any) -> Any:
    from celery import Celery

    app = Celery("bench", set_as_current=False)
    app.conf.update(broker_url=redis_url, timezone="UTC", beat_max_loop_interval=1, **conf)

    @app.task(name="bench.noop", shared=False)
    def noop() -> None:  # pragma: no cover - never executed, only published
        return None

    return app


def _entries(n: int, cron: Callable[..., Any], busy: int = 10) -> dict[str, Any]:
    # ``busy`` entries every second among daily crontabs that do not fire during the run
    return {f"e{i}": {"task": "bench.noop", "schedule": 1.0 if i < busy else cron("0", "0")} for i in range(n)}


def _interleaved(ticks: dict[str, Callable[[], Any]], count: int, pause: float) -> dict[str, list[float]]:
    """Tick each scheduler in turn, ``count`` times each: the same noise falls on all of them."""
    samples: dict[str, list[float]] = {label: [] for label in ticks}
    for _ in range(count):
        for label, tick in ticks.items():
            start = time.perf_counter()
            tick()
            samples[label].append(time.perf_counter() - start)
            time.sleep(pause)
    return samples


def _timed(fn: Callable[[], Any]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2)}


def _ticks(tick: Callable[[], Any], count: int, pause: float) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        tick()
        samples.append(time.perf_counter() - start)
        time.sleep(pause)
    return samples


@contextlib.contextmanager
def _beat_stop_handlers() -> Iterator[None]:
    """SIGTERM and SIGINT handled as ``celery beat`` handles them (``install_sync_handler``: a Python
    handler that raises SystemExit), so a tick's stop-signal hold costs what it costs under beat."""

    def _stop(signum: int, frame: Any) -> None:  # pragma: no cover - no signal is sent
        raise SystemExit()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _redbeat(redis_url: str, busy: int, lock: bool, prefix: str) -> Any:
    """A celery-redbeat scheduler over 10,000 entries (``busy`` due every second), its lock on or off;
    on, it is taken as ``celery beat`` takes it (``acquire_distributed_beat_lock``) and each tick extends it."""
    from celery.schedules import crontab as celery_crontab
    from redbeat import RedBeatScheduler
    from redbeat.schedulers import LUA_EXTEND_TO_SCRIPT, get_redis

    lock_key = f"{prefix}:lock" if lock else None
    app = _app(
        redis_url,
        beat_schedule=_entries(N_ENTRIES, celery_crontab, busy=busy),
        redbeat_redis_url=redis_url,
        redbeat_key_prefix=prefix,
        redbeat_lock_key=lock_key,
    )
    # the lock outlives any gap between two ticks here (its default, 5 x max_interval = 5 s, expired
    # once in CI while a loaded machine built the first schedule): the extend per tick is what is measured
    red = RedBeatScheduler(app=app, max_interval=1, lock_key=lock_key, lock_timeout=300)
    if lock:
        rc = get_redis(app)
        held = rc.lock(red.lock_key, timeout=red.lock_timeout, sleep=red.max_interval)
        held.lua_extend = rc.register_script(LUA_EXTEND_TO_SCRIPT)
        held.acquire()
        red.lock = held
    else:
        red.lock_key = None
    return red


def bench_idle(redis_url: str, count: int, tmp: Path) -> dict[str, Any]:
    """The idle tick (10,000 entries, none due): SafeScheduler, celery-redbeat with its lock off (as
    in the other redbeat rows) and with it on (the lease work ours always does: redbeat's lock extend,
    one more round trip), ticked in turn, ``count`` times each, so the same machine noise falls on all
    three. Ours runs with beat's stop-signal handlers installed, as under ``celery beat``."""
    from celery_safe_time import crontab
    from celery_safe_time.beat.scheduler import SafeScheduler

    out: dict[str, Any] = {}
    app = _app(redis_url, beat_schedule=_entries(N_ENTRIES, crontab, busy=0), safe_time_beat_lease=6)
    safe = SafeScheduler(app=app, schedule_filename=str(tmp / "safe-idle"), max_interval=1)
    reds: dict[str, Any] = {}
    try:
        while safe.keeper.epoch is None:
            time.sleep(0.1)
        safe.tick()
        for label, lock, prefix in (
            ("RedBeatScheduler idle", False, "redbeat:"),
            ("RedBeatScheduler (lock on) idle", True, "redbeat-locked:"),
        ):
            reds[label] = _redbeat(redis_url, 0, lock, prefix)
            reds[label].tick()
        time.sleep(1.1)
        with _beat_stop_handlers():
            samples = _interleaved(
                {"SafeScheduler idle": safe.tick, **{label: red.tick for label, red in reds.items()}}, count, 0.005
            )
        for label, values in samples.items():
            out[label] = {**_ms(values), "interleaved": True}
        out["RedBeatScheduler idle"]["lock"] = "off"
        out["RedBeatScheduler (lock on) idle"]["lock"] = "on"
    finally:
        for red in reds.values():
            red.close()
        safe.close()
    redis.Redis.from_url(redis_url).flushdb()
    return out


def bench_ticks(redis_url: str, quick: bool, tmp: Path) -> dict[str, Any]:
    from celery.beat import PersistentScheduler

    from celery_safe_time.beat.scheduler import SafeScheduler

    client = redis.Redis.from_url(redis_url)
    count = 100 if quick else 600
    out: dict[str, Any] = {}

    from celery.schedules import crontab as celery_crontab

    from celery_safe_time import crontab

    app = _app(redis_url, beat_schedule=_entries(N_ENTRIES, crontab), safe_time_beat_lease=6)
    safe = SafeScheduler(app=app, schedule_filename=str(tmp / "safe"), max_interval=1)
    try:
        while safe.keeper.epoch is None:
            time.sleep(0.1)
        first = time.perf_counter()
        safe.tick()  # reconcile: 10,000 new entries into Redis
        out["SafeScheduler first tick (10k new entries)"] = {"s": round(time.perf_counter() - first, 2)}
        time.sleep(1.1)
        samples = _ticks(safe.tick, count, 0.02)
        out["SafeScheduler"] = _ms(samples)
        guard = []
        for i in range(1000 if quick else 5000):
            start = time.perf_counter()
            safe.lease.dispatch(safe.keeper.epoch or 0, "bench-guard", 1e9 + i, "{}", 2e9)
            guard.append(time.perf_counter() - start)
        out["guard per slot"] = {
            "p50_us": round(_pct(guard, 0.5) * 1e6),
            "p99_us": round(_pct(guard, 0.99) * 1e6),
            "round_trips": 1,
        }
        # the floor of a tick that sends 10 tasks: 10 Celery publishes on beat's producer, nothing else
        entry = safe.schedule["e0"]
        floor = []
        for _ in range(count // 2):
            start = time.perf_counter()
            for _ in range(10):
                safe.app.send_task(entry.task, producer=safe.producer)
            floor.append(time.perf_counter() - start)
            time.sleep(0.005)
        out["10 Celery publishes"] = _ms(floor)
        # the same 10 in one batch, as a tick now sends the slots due together (one round trip on Redis)
        from celery_safe_time.messages.publishing import PublishBatch, batched_publish

        batched = []
        for _ in range(count // 2):
            start = time.perf_counter()
            with batched_publish(safe.producer, 10, PublishBatch()):
                for _ in range(10):
                    safe.app.send_task(entry.task, producer=safe.producer)
            batched.append(time.perf_counter() - start)
            time.sleep(0.005)
        out["10 Celery publishes, batched"] = _ms(batched)
    finally:
        safe.close()
    client.flushdb()

    app2 = _app(redis_url, beat_schedule=_entries(N_ENTRIES, celery_crontab))
    plain = PersistentScheduler(app=app2, schedule_filename=str(tmp / "plain"), max_interval=1)
    try:
        first = time.perf_counter()
        plain.tick()  # builds the heap: is_due of all 10,000 entries
        out["PersistentScheduler first tick"] = {"s": round(time.perf_counter() - first, 2)}
        time.sleep(1.1)
        # ~100 ms a tick: a quarter of the samples keeps `make bench` under 15 minutes
        out["PersistentScheduler"] = _ms(_ticks(plain.tick, count // 4, 0.02))
    finally:
        plain.close()
    client.flushdb()
    # celery-redbeat with the same entries; its lock is off (lock_key None) so the tick timed is the
    # schedule read + publish only: with the lock each tick also pays one more round trip (extend).
    red = _redbeat(redis_url, 10, False, "redbeat:")
    try:
        first = time.perf_counter()
        red.tick()
        out["RedBeatScheduler first tick"] = {"s": round(time.perf_counter() - first, 2)}
        time.sleep(1.1)
        out["RedBeatScheduler"] = _ms(_ticks(red.tick, count // 2, 0.02))
    finally:
        red.close()
    client.flushdb()
    # idle: the same 10,000 entries, none due (what a tick costs when it has nothing to send)
    out.update(bench_idle(redis_url, count, tmp))
    idle_app = _app(redis_url, beat_schedule=_entries(N_ENTRIES, celery_crontab, busy=0))
    plain = PersistentScheduler(app=idle_app, schedule_filename=str(tmp / "plain-idle"), max_interval=1)
    try:
        plain.tick()
        out["PersistentScheduler idle"] = _ms(_ticks(plain.tick, count // 4, 0.005))
    finally:
        plain.close()
    client.flushdb()
    return out


# --- beat backends: Redis vs PostgreSQL coordination --------------------------------------------
N_BACKEND_ENTRIES = 10_000
N_BACKEND_ENTRIES_QUICK = 1_000


def bench_backends(redis_url: str, quick: bool, tmp: Path, postgres_url: str) -> dict[str, Any]:
    """SafeScheduler on the Redis backend and on the PostgreSQL one, same entries, ticked in turn (the
    same noise falls on both): a tick with 10 entries due every second, an idle tick, the guard."""
    from celery_safe_time import crontab
    from celery_safe_time.beat.scheduler import SafeScheduler

    n = N_BACKEND_ENTRIES_QUICK if quick else N_BACKEND_ENTRIES
    count = 60 if quick else 300
    out: dict[str, Any] = {"entries": n}
    conf = {
        "redis": {},
        "postgres": {"safe_time_coordination_url": postgres_url, "safe_time_key_prefix": "bench-beat:"},
    }
    for busy, suffix in ((10, ""), (0, " idle")):
        scheds = {}
        try:
            for label, extra in conf.items():
                app = _app(redis_url, beat_schedule=_entries(n, crontab, busy=busy), safe_time_beat_lease=6, **extra)
                sched = SafeScheduler(app=app, schedule_filename=str(tmp / f"backend-{label}{busy}"), max_interval=1)
                while sched.keeper.epoch is None:
                    time.sleep(0.1)
                first = time.perf_counter()
                sched.tick()  # the reconcile: n new entries
                if not suffix:
                    out[f"{label} first tick s"] = round(time.perf_counter() - first, 2)
                scheds[label] = sched
            time.sleep(1.1)
            samples = _interleaved({label: sched.tick for label, sched in scheds.items()}, count, 0.02)
            for label, values in samples.items():
                out[f"{label} tick{suffix}"] = _ms(values)
            if not suffix:
                for label, sched in scheds.items():
                    guard = []
                    for i in range(300 if quick else 2000):
                        start = time.perf_counter()
                        sched.lease.dispatch(sched.keeper.epoch or 0, "bench-guard", 1e9 + i, "{}", 2e9)
                        guard.append(time.perf_counter() - start)
                    out[f"{label} guard"] = {
                        "p50_us": round(_pct(guard, 0.5) * 1e6),
                        "p99_us": round(_pct(guard, 0.99) * 1e6),
                    }
        finally:
            for sched in scheds.values():
                sched.close()
            redis.Redis.from_url(redis_url).flushdb()
            _drop_beat_rows(postgres_url, "bench-beat:")
    return out


def _drop_beat_rows(postgres_url: str, ns: str) -> None:
    import sqlalchemy as sa

    from celery_safe_time.beat.backends import postgres as pg

    engine = sa.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            for table in (pg.LEASE_TABLE, pg.FIRED_TABLE, pg.STATE_TABLE, pg.META_TABLE, pg.ENTRIES_TABLE):
                conn.execute(sa.text(f"DELETE FROM {table} WHERE ns = :ns"), {"ns": ns})
    finally:
        engine.dispose()


# --- runtime entries --------------------------------------------------------------------
_ZONES = ("Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "UTC")


def _runtime_specs(n: int, busy: int = 10) -> list[tuple[str, Any]]:
    """(name, schedule) of ``n`` tenants: ``busy`` every second, the rest 09:00 in their own timezone."""
    from celery_safe_time import crontab

    out: list[tuple[str, Any]] = []
    for i in range(n):
        if i < busy:
            out.append((f"tenant-{i}", 1.0))
        else:
            out.append((f"tenant-{i}", crontab(minute=str(i % 60), hour="9", tz=_ZONES[i % len(_ZONES)])))
    return out


def _memory(client: redis.Redis, keys: list[str]) -> int:
    return sum(int(client.memory_usage(k, samples=0) or 0) for k in keys)


def _tick_loop(tick: Callable[[], float], stop: Any) -> None:
    """What ``celery beat`` does: tick, sleep what it asked for (at most the 1 s max interval)."""
    while not stop.is_set():
        stop.wait(min(1.0, max(0.0, tick())))


def _save_to_fire(save: Callable[[str], None], fired: dict[str, float], count: int) -> list[float]:
    samples = []
    for i in range(count):
        name = f"probe-{i}-{time.monotonic_ns()}"
        start = time.monotonic()
        save(name)
        deadline = start + 10
        while name not in fired and time.monotonic() < deadline:
            time.sleep(0.002)
        samples.append(fired.get(name, deadline) - start)
        time.sleep(random.uniform(0.05, 1.0))  # saves land anywhere in the tick cycle
    return samples


def bench_runtime(redis_url: str, quick: bool, tmp: Path) -> dict[str, Any]:
    """``save_entry`` vs redbeat's ``RedBeatSchedulerEntry.save`` with the same entries, in one run."""
    import threading

    from celery.schedules import crontab as celery_crontab
    from redbeat import RedBeatScheduler, RedBeatSchedulerEntry

    from celery_safe_time import save_entry, signals
    from celery_safe_time.beat.backends.redis import BeatKeys
    from celery_safe_time.beat.entries import _Store, definition_json, schedule_to_spec
    from celery_safe_time.beat.scheduler import SafeScheduler
    from celery_safe_time.clock import UTC

    n = N_RUNTIME_QUICK if quick else N_RUNTIME
    # 10 entries fall due each second and the two schedulers are ticked in turn every ~10 ms, so only
    # about one sample in 50 is a tick that publishes: 1,500 each put ~30 of those in the p99, not ~6.
    count = 60 if quick else 1500
    probes = 10 if quick else 30
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    specs = _runtime_specs(n)
    out: dict[str, Any] = {"entries": n}

    # --- ours ---
    app = _app(redis_url, safe_time_beat_lease=6)
    sample = min(1000, n)
    start = time.perf_counter()
    for name, schedule in specs[:sample]:
        save_entry(name, "bench.noop", schedule, app=app)
    save_s = (time.perf_counter() - start) / sample
    # the rest through the same script, pipelined (save_entry's validation costs CPU, not Redis)
    store = _Store(app)
    script = client.register_script(load_script("celery_safe_time.beat", "save_entry"))
    keys = BeatKeys.for_config(store.config)
    pipe = client.pipeline(transaction=False)
    for i, (name, schedule) in enumerate(specs[sample:]):
        raw = definition_json(name, "bench.noop", schedule_to_spec(schedule), (), {}, {}, True)
        script(keys=[keys.entries, keys.version, keys.changed], args=[name, raw], client=pipe)
        if i % 2000 == 1999:
            pipe.execute()
    pipe.execute()
    fired: dict[str, float] = {}

    def on_sent(sender: Any, entry: str, **kw: Any) -> None:
        fired.setdefault(entry, time.monotonic())

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    from celery_safe_time import crontab

    def leader(label: str) -> SafeScheduler:
        sched = SafeScheduler(app=app, schedule_filename=str(tmp / label), max_interval=1)
        while sched.keeper.epoch is None:
            time.sleep(0.05)
        return sched

    # a fresh leader (no state in Redis: it plans and writes every entry), then one taking over from it
    safe = leader("rt-fresh")
    out["ours first tick, fresh"] = _timed(safe.tick)
    safe.close()
    safe = leader("rt")
    out["ours first tick, takeover"] = _timed(safe.tick)
    out["ours first tick (load all) s"] = out["ours first tick, takeover"]["s"]
    # ours with 10,000 static entries (another key prefix, same Redis), ticked in turn with the 100,000
    static_app = _app(
        redis_url,
        beat_schedule=_entries(N_ENTRIES, crontab),
        safe_time_beat_lease=6,
        safe_time_key_prefix="bench_static:",
    )
    static = SafeScheduler(app=static_app, schedule_filename=str(tmp / "static"), max_interval=1)
    try:
        while static.keeper.epoch is None:
            time.sleep(0.05)
        static.tick()
        time.sleep(1.1)
        both = _interleaved({"runtime": safe.tick, "static": static.tick}, count, 0.01)
        out["ours tick"] = _ms(both["runtime"])
        out["ours tick, 10k static, interleaved"] = _ms(both["static"])
    finally:
        static.close()
    try:
        stop = threading.Event()
        loop = threading.Thread(target=_tick_loop, args=(safe.tick, stop), daemon=True)
        loop.start()
        try:
            out["ours save to first fire"] = _ms(
                _save_to_fire(lambda name: save_entry(name, "bench.noop", datetime.now(UTC), app=app), fired, probes)
            )
        finally:
            stop.set()
            loop.join(5)
        backend_keys = safe.backend.keys  # the Redis backend's keys
        ours_keys = [keys.entries, keys.changed, backend_keys.state, backend_keys.due]
        out["ours bytes per entry"] = round(_memory(client, ours_keys) / n)
        out["ours save_entry ms"] = round(save_s * 1000, 3)
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
        safe.close()
    client.flushdb()

    # --- celery-redbeat, the same entries through its entry API ---
    red_app = _app(redis_url, redbeat_redis_url=redis_url, redbeat_lock_key=None)
    start = time.perf_counter()
    for i, (name, schedule) in enumerate(specs):
        sched = schedule
        if not isinstance(schedule, float):  # redbeat stores celery's crontab (no tz field)
            sched = celery_crontab(minute=schedule._orig_minute, hour=schedule._orig_hour)
        RedBeatSchedulerEntry(name, "bench.noop", sched, app=red_app).save()
        if i + 1 == sample:
            out["redbeat save ms"] = round((time.perf_counter() - start) / sample * 1000, 3)
    red_fired: dict[str, float] = {}

    class Recording(RedBeatScheduler):  # type: ignore[misc]
        def apply_async(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
            red_fired.setdefault(entry.name, time.monotonic())
            return super().apply_async(entry, *args, **kwargs)

    red = Recording(app=red_app, max_interval=1, lock_key=None)
    try:
        red.lock_key = None
        first = time.perf_counter()
        red.tick()
        out["redbeat first tick s"] = round(time.perf_counter() - first, 2)
        time.sleep(1.1)
        out["redbeat tick"] = _ms(_ticks(red.tick, count, 0.02))
        stop = threading.Event()
        loop = threading.Thread(target=_tick_loop, args=(red.tick, stop), daemon=True)
        loop.start()
        try:
            out["redbeat save to first fire"] = _ms(
                _save_to_fire(
                    # a new redbeat entry is due one interval after "now": back-date its last run so
                    # that it is due at once, like our one-off at "now"
                    lambda name: RedBeatSchedulerEntry(
                        name, "bench.noop", 3600.0, last_run_at=datetime.now(UTC) - timedelta(hours=1), app=red_app
                    ).save(),
                    red_fired,
                    probes,
                )
            )
        finally:
            stop.set()
            loop.join(5)
        red_keys = [as_text(k) for k in client.scan_iter("redbeat:tenant-*", count=5000)]
        per_key = _memory(client, red_keys[:2000]) / max(1, min(2000, len(red_keys)))
        zset = _memory(client, ["redbeat::schedule"])
        out["redbeat bytes per entry"] = round(per_key + zset / n)
    finally:
        red.close()
    client.flushdb()
    return out


# --- django ---------------------------------------------------------------------------
def bench_django(redis_url: str, quick: bool) -> dict[str, Any]:
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    os.environ["SAFE_TIME_TEST_DJANGO_DB_URL"] = db.url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection
        from django.utils import timezone
        from django_celery_beat.models import IntervalSchedule, PeriodicTask
        from django_celery_beat.schedulers import DatabaseScheduler

        from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler

        call_command("migrate", verbosity=0, interactive=False)
        every = IntervalSchedule.objects.create(every=3600, period=IntervalSchedule.SECONDS)
        now = timezone.now()
        PeriodicTask.objects.bulk_create(
            [PeriodicTask(name=f"t{i}", task="bench.noop", interval=every, last_run_at=now) for i in range(N_ENTRIES)],
            batch_size=2000,
        )
        count = 60 if quick else 300
        out: dict[str, Any] = {}
        for label, cls in (("SafeDatabaseScheduler", SafeDatabaseScheduler), ("DatabaseScheduler", DatabaseScheduler)):
            app = _app(redis_url, safe_time_beat_lease=6)
            start = time.perf_counter()
            sched = cls(app=app, max_interval=1)
            if isinstance(sched, SafeDatabaseScheduler):
                while sched.keeper.epoch is None:
                    time.sleep(0.05)
            sched.tick()
            first = time.perf_counter() - start
            out[label] = {"first_tick_s": round(first, 2), **_ms(_ticks(sched.tick, count, 0.02))}
            sched.close()
            redis.Redis.from_url(redis_url).flushdb()
        connection.close()
        return out
    finally:
        db.drop()


def run(quick: bool, only: str | None = None) -> dict[str, Any]:
    """``only``: "failover" runs just the failover race, "timed" everything else (``benchmarks.run``
    runs the failover race, seconds of waiting on a lease, in the background)."""
    claim = services.RedisDbClaim(services.resolve_redis_base())
    redis_url = claim.url
    redis.Redis.from_url(redis_url).flushdb()
    results: dict[str, Any] = {"quick": quick}
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    try:
        if only == "runtime":  # python -m benchmarks.beat --only runtime: just the runtime entries
            with tempfile.TemporaryDirectory() as tmp:
                results["runtime"] = bench_runtime(redis_url, quick, Path(tmp))
            return results
        if only != "failover":
            with tempfile.TemporaryDirectory() as tmp:
                results["ticks"] = bench_ticks(redis_url, quick, Path(tmp))
                results["runtime"] = bench_runtime(redis_url, quick, Path(tmp))
                results["backends"] = bench_backends(redis_url, quick, Path(tmp), db.url)
            results["django"] = bench_django(redis_url, quick)
            redis.Redis.from_url(redis_url).flushdb()
        if only != "timed":
            results["failover"] = bench_failover(redis_url, quick, db.url)
    finally:
        redis.Redis.from_url(redis_url).flushdb()
        claim.release()
        from celery_safe_time.coordination import dispose_engines

        dispose_engines()
        db.drop()
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = ["| measurement | celery-safe-time | baseline |", "|---|---|---|"]
    f = results.get("failover", {})
    safe, red = f.get("SafeScheduler (lease 30 s)", {}), f.get("celery-redbeat (defaults)", {})
    lines.append(
        f"| failover after kill -9 (s) | {safe.get('failover_s')} (bound {safe.get('bound_s')}) "
        f"| redbeat defaults: {red.get('failover_s') or red.get('note')} (bound {red.get('bound_s')}) |"
    )
    pgf = f.get("SafeScheduler on PostgreSQL (lease 30 s)", {})
    if pgf:
        lines.append(
            f"| failover after kill -9, lease in PostgreSQL (s) | {pgf.get('failover_s') or pgf.get('note')} "
            f"(bound {pgf.get('bound_s')}) | lease in Redis, same run: {safe.get('failover_s')} |"
        )
    b = results.get("backends", {})
    if b:
        n = f"{b.get('entries', 0):,}"
        for suffix, what in (("", "10 due/s"), (" idle", "none due")):
            pg, rd = b.get(f"postgres tick{suffix}", {}), b.get(f"redis tick{suffix}", {})
            lines.append(
                f"| tick on PostgreSQL coordination, {n} entries, {what}: p50 / p99 (ms) "
                f"| {pg.get('p50_ms')} / {pg.get('p99_ms')} | Redis backend, ticked in turn: "
                f"{rd.get('p50_ms')} / {rd.get('p99_ms')} |"
            )
        pgg, rdg = b.get("postgres guard", {}), b.get("redis guard", {})
        lines.append(
            f"| guard per slot on PostgreSQL: p50 / p99 (us) | {pgg.get('p50_us')} / {pgg.get('p99_us')} "
            f"| Redis: {rdg.get('p50_us')} / {rdg.get('p99_us')} |"
        )
        lines.append(
            f"| {n} entries: a new leader's first tick (s) | PostgreSQL: {b.get('postgres first tick s')} "
            f"| Redis: {b.get('redis first tick s')} |"
        )
    t = results.get("ticks", {})
    s, p = t.get("SafeScheduler", {}), t.get("PersistentScheduler", {})
    lines.append(
        f"| tick, 10k entries, 10 due/s: p50 / p99 (ms) | {s.get('p50_ms')} / {s.get('p99_ms')} "
        f"| PersistentScheduler: {p.get('p50_ms')} / {p.get('p99_ms')} |"
    )
    r, ri = t.get("RedBeatScheduler", {}), t.get("RedBeatScheduler idle", {})
    lines.append(
        f"| celery-redbeat tick (lock off), 10k entries, 10 due/s / none due: p50 / p99 (ms) | - "
        f"| {r.get('p50_ms')} / {r.get('p99_ms')}; idle {ri.get('p50_ms')} / {ri.get('p99_ms')} |"
    )
    si, pi = t.get("SafeScheduler idle", {}), t.get("PersistentScheduler idle", {})
    lines.append(
        f"| tick, 10k entries, none due: p50 / p99 (ms) | {si.get('p50_ms')} / {si.get('p99_ms')} "
        f"| PersistentScheduler: {pi.get('p50_ms')} / {pi.get('p99_ms')} |"
    )
    rl = t.get("RedBeatScheduler (lock on) idle", {})
    if rl:
        lines.append(
            f"| idle tick, 10k entries, ticked in turn with celery-redbeat: p50 / p99 (ms) "
            f"| {si.get('p50_ms')} / {si.get('p99_ms')} | redbeat lock off: {ri.get('p50_ms')} / "
            f"{ri.get('p99_ms')}; lock on (extend each tick): {rl.get('p50_ms')} / {rl.get('p99_ms')} |"
        )
    g = t.get("guard per slot", {})
    lines.append(
        f"| guard per published slot | {g.get('p50_us')} us p50, {g.get('p99_us')} us p99, 1 round trip | none |"
    )
    cp, cb = t.get("10 Celery publishes", {}), t.get("10 Celery publishes, batched", {})
    if cp:
        lines.append(
            f"| 10 Celery publishes alone, in one batch (the floor of a tick sending 10 tasks): p50 / p99 (ms) "
            f"| {cb.get('p50_ms')} / {cb.get('p99_ms')} | one by one: {cp.get('p50_ms')} / {cp.get('p99_ms')} |"
        )
    rt = results.get("runtime", {})
    if rt:
        n = f"{rt.get('entries', 0):,}"
        ot, rb = rt.get("ours tick", {}), rt.get("redbeat tick", {})
        lines.append(
            f"| {n} runtime entries, 10 due/s: tick p50 / p99 (ms) | {ot.get('p50_ms')} / {ot.get('p99_ms')} "
            f"| celery-redbeat, same entries: {rb.get('p50_ms')} / {rb.get('p99_ms')} |"
        )
        st = rt.get("ours tick, 10k static, interleaved", {})
        if st:
            lines.append(
                f"| {n} runtime entries vs ours with 10,000 static entries, ticked in turn: p50 / p99 (ms) "
                f"| {ot.get('p50_ms')} / {ot.get('p99_ms')} | 10k static: {st.get('p50_ms')} / {st.get('p99_ms')} |"
            )
        fr, tk = rt.get("ours first tick, fresh", {}), rt.get("ours first tick, takeover", {})
        if fr:
            lines.append(
                f"| {n} runtime entries: a leader's first tick, wall / CPU (s) | fresh (no state): "
                f"{fr.get('s')} / {fr.get('cpu_s')}; takeover (state in Redis): {tk.get('s')} / {tk.get('cpu_s')} "
                f"| - |"
            )
        of, rf = rt.get("ours save to first fire", {}), rt.get("redbeat save to first fire", {})
        lines.append(
            f"| {n} runtime entries: save to the leader's first fire, p50 / p99 (ms) "
            f"| {of.get('p50_ms')} / {of.get('p99_ms')} | celery-redbeat: {rf.get('p50_ms')} / {rf.get('p99_ms')} |"
        )
        lines.append(
            f"| {n} runtime entries: Redis memory per entry (bytes) | {rt.get('ours bytes per entry')} "
            f"| celery-redbeat: {rt.get('redbeat bytes per entry')} |"
        )
        lines.append(
            f"| {n} runtime entries: one save (ms) / the leader's first tick, loading all (s) "
            f"| {rt.get('ours save_entry ms')} / {rt.get('ours first tick (load all) s')} "
            f"| celery-redbeat: {rt.get('redbeat save ms')} / {rt.get('redbeat first tick s')} |"
        )
    d = results.get("django", {})
    sd, dd = d.get("SafeDatabaseScheduler", {}), d.get("DatabaseScheduler", {})
    lines.append(
        f"| 10k periodic tasks: first tick (s) | {sd.get('first_tick_s')} "
        f"| DatabaseScheduler: {dd.get('first_tick_s')} |"
    )
    lines.append(
        f"| 10k periodic tasks: tick p50 / p99 (ms) | {sd.get('p50_ms')} / {sd.get('p99_ms')} "
        f"| DatabaseScheduler: {dd.get('p50_ms')} / {dd.get('p99_ms')} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["runtime", "timed", "failover"], default=None)
    args = parser.parse_args(argv)
    results = run(args.quick, args.only)
    return print_report(markdown(results), results)


if __name__ == "__main__":
    sys.exit(main())
