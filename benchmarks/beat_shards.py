"""The burst fired by three beats sharing ``SHARDS`` shards (``safe_time_beat_shards``), for
``benchmarks.beat_scale --burst-only``: beside one leader, in the same run, on the same entries.

Three processes each run a ``SafeScheduler`` with the shards on: they share the shard leases out,
each plans the shards it holds, and reports ready once it holds its share and has planned it. Then
the benchmark names one real instant (Redis ``TIME``) as 1 s before the burst for all three (their clocks
moved alike), and each ticks until every slot is in the broker queue. Measured: the burst to the last
publish of any beat, the slots each published, the beats' CPU together, and each entry's messages
counted in the queue (exactly once).

``python -m benchmarks.beat_shards --idle SECONDS``: the CPU of an idle beat that holds one shard and
stands by for another (held by a lease of this benchmark), each shard's tick work in turn (every
held shard ticked at each standby wake, as beats did) beside its own cadence (``SafeScheduler.tick``),
in the same run on the same Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

SHARDS = 6
BEATS = 3
#: the key prefix (the rows' ``ns``) of the entries the sharded beats fire on PostgreSQL coordination
SHARDED_POSTGRES_PREFIX = "bench-burst-sharded:"
READY = "bench-shards:ready:{index}"
GO = "bench-shards:go"
#: how long the beats get to share the shards out and plan them
SETUP_TIMEOUT = 900.0


def shard_child(redis_url: str, n: int, hour: int, index: int, coordination: str | None = None) -> dict[str, Any]:
    """In a process of its own: one of the beats (see the module docstring); on PostgreSQL coordination
    with ``coordination`` (its URL; the broker and the benchmark's flags stay on Redis)."""
    from benchmarks.beat_scale import BURST_GIVE_UP, BURST_LEAD, BURST_PLAN_AHEAD, _app
    from celery_safe_time import signals
    from celery_safe_time.beat.scheduler import SafeScheduler
    from tests.helpers.beat import ShiftedClock, burst_after

    app = _app(redis_url, coordination, SHARDED_POSTGRES_PREFIX)
    app.conf.safe_time_beat_shards = SHARDS
    client = redis.Redis.from_url(redis_url)
    sent = [0]

    def on_sent(sender: Any, **kwargs: Any) -> None:
        sent[0] += 1

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    out: dict[str, Any] = {"beat": index}
    with tempfile.TemporaryDirectory() as tmp:
        sched = SafeScheduler(app=app, schedule_filename=str(Path(tmp) / "burst"), max_interval=1)
        scheds = [sched, *sched.shard_children]
        real = sched.clock
        burst = burst_after(real.time(), hour)
        clock = ShiftedClock(real, burst - BURST_PLAN_AHEAD - real.time())
        for s in scheds:
            s.lazy_threshold = min(s.lazy_threshold, n // 2)  # a small run reads only due entries too
            s.clock = clock
        share = SHARDS // BEATS
        started = time.monotonic()
        while (go := client.get(GO)) is None and time.monotonic() - started < SETUP_TIMEOUT:
            wait = sched.tick()
            held = [s for s in scheds if s.keeper.term is not None]
            planned = all(s._reconciled == s.keeper.term and not s.replanning for s in held)
            client.set(READY.format(index=index), "1" if len(held) == share and planned else "0")
            time.sleep(min(wait, 0.05))
        if go is None:
            raise SystemExit("no go from the benchmark")
        fire_at = float(go)
        clock.shift = burst - BURST_LEAD - fire_at  # the same for every beat: the burst at fire_at + 1 s
        out["shards"] = sorted(s.shard for s in scheds if s.keeper.term is not None)
        while real.time() < fire_at:
            time.sleep(0.01)
        cpu = time.process_time()
        sent[0] = 0
        last = burst
        while clock.time() < burst + BURST_GIVE_UP:
            before = sent[0]
            wait = sched.tick()
            if sent[0] > before:
                last = clock.time()
            if clock.time() > burst and client.llen("celery") >= n:
                break
            if wait > 0:
                time.sleep(min(wait, 0.05))
        out["cpu_s"] = round(time.process_time() - cpu, 3)
        out["published"] = sent[0]
        out["to last publish s"] = round(last - burst, 3)
        sched.close()
    return out


def _run_beats(
    client: redis.Redis, args: list[str], logs: list[Any], root: Path, env: dict[str, str]
) -> list[dict[str, Any]] | str:
    """Start the beats, wait until they are ready, name the instant, and collect what each measured
    (or the error of one that failed)."""
    procs = [
        subprocess.Popen([*args, str(i)], stdout=log, stderr=subprocess.STDOUT, text=True, cwd=str(root), env=env)
        for i, log in enumerate(logs)
    ]
    try:
        ready_since = None
        deadline = time.monotonic() + SETUP_TIMEOUT
        while time.monotonic() < deadline:
            flags = client.mget([READY.format(index=i) for i in range(BEATS)])
            ready = all(flag == b"1" for flag in flags)
            ready_since = (ready_since or time.monotonic()) if ready else None
            if ready_since is not None and time.monotonic() - ready_since >= 3.0:
                break  # shared out and planned, and it stays so
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        seconds, micros = client.time()
        client.set(GO, repr(seconds + micros / 1e6 + 2.0))
        outs = []
        for p, log in zip(procs, logs, strict=True):
            p.wait(timeout=SETUP_TIMEOUT)
            log.seek(0)
            text = log.read()
            if p.returncode != 0:
                return str(text[-2000:])
            outs.append(json.loads(text.strip().splitlines()[-1]))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def bench_sharded(redis_url: str, n: int, hour: int, coordination: str | None = None) -> dict[str, Any]:
    """The burst of ``n`` entries (already saved, due at ``hour``:00) fired by ``BEATS`` beats over
    ``SHARDS`` shards (on PostgreSQL coordination with ``coordination``, its URL)."""
    client = redis.Redis.from_url(redis_url)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "benchmarks.beat_scale", "--leader", redis_url, "--burst", str(n)]
    args += ["--burst-hour", str(hour)]
    if coordination:
        args += ["--coordination", coordination]
    args.append("--shard-beat")
    # files, not pipes: a beat writing more than a pipe holds would wait for a reader that waits for it
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(BEATS)]
        outs = _run_beats(client, args, logs, root, env)
    if isinstance(outs, str):
        return {"error": outs}
    last = max(o["to last publish s"] for o in outs)
    published = sum(o["published"] for o in outs)
    return {
        "entries": n,
        "to last publish s": last,
        "published": published,
        "per s": round(published / max(last, 1e-6)),
        "cpu_s": round(sum(o["cpu_s"] for o in outs), 3),
        "beats": outs,
    }


def _noop() -> None:  # pragma: no cover - never executed, only named
    return None


def _idle_loop(tick: Any, seconds: float) -> float:
    """Run beat's loop (tick, sleep what it returns) for ``seconds``; the CPU it took."""
    cpu = time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(tick(), max(0.0, end - time.monotonic())))
    return time.process_time() - cpu


def bench_idle(redis_url: str, seconds: float) -> dict[str, Any]:
    """An idle sharded beat's CPU and held-shard due reads, every held shard at each wake beside each
    at its own cadence (see the module docstring)."""
    from celery import Celery

    from celery_safe_time.beat.base import stop_signals_held
    from celery_safe_time.beat.scheduler import SafeScheduler
    from celery_safe_time.config import get_config

    prefix = f"bench-shards-idle:{uuid.uuid4().hex[:8]}:"
    app = Celery("bench-idle", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        timezone="UTC",
        safe_time_redis_url=redis_url,
        safe_time_key_prefix=prefix,
        safe_time_beat_lease=6,
        safe_time_beat_shards=2,
        beat_schedule={"hourly": {"task": "bench.noop", "schedule": 3600.0}},
    )
    app.task(name="bench.noop", shared=False)(_noop)
    client = redis.Redis.from_url(redis_url)
    out: dict[str, Any] = {"seconds": seconds}
    with tempfile.TemporaryDirectory() as tmp:
        sched = SafeScheduler(app=app, schedule_filename=str(Path(tmp) / "idle"), max_interval=5)
        standby = sched.shard_children[0]
        standby.keeper.stop(release=True)  # shard 1 is another beat's: this one stands by for it
        other = standby.backend.make_lease()
        other.acquire(standby.clock.time())
        reads = [0]
        read_due = sched.backend.read_due

        def counted(now: float, limit: int) -> Any:
            reads[0] += 1
            return read_due(now, limit)

        sched.backend.read_due = counted  # type: ignore[method-assign]
        scheds = [sched, *sched.shard_children]

        def every_wake() -> float:  # each shard's tick in turn, the shortest wait (the cadence before)
            with stop_signals_held():
                return min(s._tick_shard() for s in scheds)

        try:
            sched.tick()  # plans shard 0
            for label, tick in (("every held shard at each wake", every_wake), ("own cadence", sched.tick)):
                reads[0] = 0
                cpu = _idle_loop(tick, seconds)
                out[label] = {"cpu_s": round(cpu, 3), "held-shard due reads": reads[0]}
                other.renew()
        finally:
            other.release()
            sched.close()
            keys = list(client.scan_iter(match=get_config(app).key_prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--idle", type=float, default=10.0, help="Seconds of each idle loop (default 10).")
    parser.add_argument("--redis", default=os.environ.get("SAFE_TIME_BENCH_REDIS", "redis://127.0.0.1:6379/0"))
    args = parser.parse_args(argv)
    print(json.dumps(bench_idle(args.redis, args.idle), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
