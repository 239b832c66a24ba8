"""The two correctness rows of the benchmark table, measured side by side with plain Celery.

1. Executions of a countdown longer than the broker's visibility_timeout: SafeTask vs a plain
   task, same worker, same run. Redis redelivers an unacked message once its visibility_timeout
   has passed; kombu only looks every ``unacked_restore_interval`` (default 60 s)... so the run sets
   it and ``unacked_restore_throttle`` to 1 s to show in seconds what takes hours in production.
2. Duplicate slots with 3 beats for N minutes, one leader killed (-9) and one paused (SIGSTOP for
   longer than the lease, then resumed), vs 3 plain ``celery beat`` processes given the same
   treatment, both sides running at the same time. No worker: a drain thread pops the published
   messages from each side's queue and reads the task name and (ours) the slot header.

``python -m benchmarks.safety [--quick]``.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import percentile
from benchmarks.delays import Env
from tests.helpers import services
from tests.helpers.beat import BEAT_APP, leader_pid
from tests.helpers.processes import CeleryProcess, wait_for

# --- 1. countdown longer than visibility_timeout ------------------------------------------


def bench_visibility(
    quick: bool, broker: str = "redis", endpoint: services.SqsEndpoint | None = None, spread: int = 0
) -> dict[str, Any]:
    """``broker="sqs"``: the same on ``endpoint``, a local SQS-compatible endpoint (moto's server mode,
    started by ``benchmarks.sqs``); SQS hands an unacknowledged message out again by itself once its
    visibility timeout passes. ``spread``: that many more SafeTask calls, due one by one between the
    visibility timeout and the countdown, whose lateness (start minus due time) is measured."""
    vt = 3.0 if quick else 5.0
    countdown = 10.0 if quick else 30.0
    n = 10 if quick else 20
    env = Env()
    try:
        env.store().close()
        if broker == "sqs":
            if endpoint is None:
                raise ValueError("endpoint: required with broker='sqs'")
            transport = services.sqs_transport_options("bench-", visibility_timeout=vt)
            conf = env.conf(broker=endpoint.url, broker_transport_options=transport, safe_time_sweep_interval=1)
        else:
            conf = env.conf(
                broker_transport_options={
                    "visibility_timeout": vt,
                    # kombu restores expired unacked messages at most this often (defaults 60 s / 60 s)
                    "unacked_restore_interval": 1,
                    "unacked_restore_throttle": 1,
                },
                safe_time_sweep_interval=1,
            )
        # two workers: a redelivered message may go to either, as in a real deployment
        env.worker("vis-a", conf, concurrency=2)
        env.worker("vis-b", conf, concurrency=2)
        beat_args = ["beat", "-l", "WARNING", "-S", "celery.beat:PersistentScheduler", "-s", str(env.tmp / "vis-beat")]
        env.spawn("vis-beat", beat_args, conf)  # runs the sweep every second
        keep = ("broker_transport", "safe_time")
        app = env.app(conf.get("broker_url"), **{k: v for k, v in conf.items() if k.startswith(keep)})
        for i in range(n):
            app.tasks["tests.delays.record"].apply_async((f"safe-{i}",), countdown=countdown)
            app.tasks["tests.delays.plain_record"].apply_async((f"plain-{i}",), countdown=countdown)
        for i in range(spread):
            due_in = vt + 1 + (countdown - vt - 1) * i / max(1, spread - 1)
            app.tasks["tests.delays.record"].apply_async((f"spread-{i}",), countdown=due_in)
        settle = countdown + 2 * vt + 8  # the last redelivered copies fire at ~countdown; then the sweep, margin
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            time.sleep(1)
        runs = [json.loads(raw) for raw in env.redis.lrange("test:runs", 0, -1)]
        counts = collections.Counter(r["label"] for r in runs)
        safe = [counts.get(f"safe-{i}", 0) for i in range(n)]
        plain = [counts.get(f"plain-{i}", 0) for i in range(n)]
        lateness = sorted(
            r["started"] - datetime.fromisoformat(r["stored_due"]).timestamp()
            for r in runs
            if str(r["label"]).startswith(("safe-", "spread-")) and r.get("stored_due")
        )
        spread_runs = [counts.get(f"spread-{i}", 0) for i in range(spread)]
        return {
            "broker": broker,
            "visibility_timeout_s": vt,
            "countdown_s": countdown,
            "tasks": n,
            "waited_s": settle,
            "safe_executions": safe,
            "plain_executions": plain,
            "safe_mean": sum(safe) / n,
            "plain_mean": sum(plain) / n,
            "safe_max": max(safe),
            "plain_max": max(plain),
            "safe_missing": sum(1 for c in safe if c == 0),
            "spread_tasks": spread,
            "spread_max": max(spread_runs, default=0),
            "spread_missing": sum(1 for c in spread_runs if c == 0),
            # every stored call's start minus its due time: the burst of n due at once and the spread
            "lateness_samples": len(lateness),
            "lateness_p50_s": percentile(lateness, 50) if lateness else None,
            "lateness_p99_s": percentile(lateness, 99) if lateness else None,
            "lateness_max_s": lateness[-1] if lateness else None,
        }
    finally:
        env.close()


# --- 2. duplicate slots with 3 beats ----------------------------------------------------------

CRON_ENTRIES = 5


def _schedule() -> dict[str, Any]:
    sched: dict[str, Any] = {
        f"minutely-{i}": {"task": "tests.record", "cron": {"minute": "*"}, "args": [f"minutely-{i}"]}
        for i in range(CRON_ENTRIES)
    }
    sched["every-2s"] = {"task": "tests.record", "every": 2, "args": ["every-2s"]}
    return sched


class _Drain(threading.Thread):
    """Pops published task messages off one Redis db's ``celery`` list, stamping the pop time."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.seen: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            item = self.client.blpop(["celery"], timeout=0.5)
            if item is None:
                continue
            msg = json.loads(item[1])
            headers = msg.get("headers") or {}
            body = json.loads(base64.b64decode(msg["body"])) if msg.get("body") else [[]]
            args = body[0] if body and isinstance(body[0], list) else []
            self.seen.append(
                {
                    "at": time.time(),
                    "label": args[0] if args else headers.get("task"),
                    "slot": headers.get("safe_time_slot"),
                }
            )


def _count_duplicates(seen: list[dict[str, Any]], start: float, end: float, by_header: bool) -> dict[str, Any]:
    """Slots published more than once; a minutely slot is its minute, ours also by slot header."""
    per_slot: collections.Counter[tuple[str, str]] = collections.Counter()
    interval_sends = 0
    for m in seen:
        if m["label"] == "every-2s":
            interval_sends += 1
            if by_header and m["slot"]:
                per_slot[(m["label"], m["slot"])] += 1
            continue
        if by_header and m["slot"]:
            key = m["slot"]
        else:
            # published within ~1 s after the minute and popped within 0.5 s: the minute it was popped in
            key = datetime.fromtimestamp(int((m["at"] - 5) // 60 * 60)).isoformat()
        per_slot[(m["label"], key)] += 1
    dup = {f"{k[0]}@{k[1]}": n for k, n in per_slot.items() if n > 1}
    minutely = {k: n for k, n in per_slot.items() if k[0].startswith("minutely")}
    return {
        "messages": len(seen),
        "duplicate_slots": len(dup),
        "extra_messages": sum(n - 1 for n in dup.values()),
        "examples": dict(list(dup.items())[:5]),
        "minutely_slots": len(minutely),
        "minutely_messages": sum(minutely.values()),
        "interval_sends": interval_sends,
        "interval_expected": int((end - start) / 2),
    }


def _beats(side: str, url: str, scheduler: str, log_dir: Path, conf: dict[str, Any]) -> list[CeleryProcess]:
    env = {
        "SAFE_TIME_TEST_BROKER_URL": url,
        "SAFE_TIME_TEST_BEAT_SCHEDULE": json.dumps(_schedule()),
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }
    return [
        CeleryProcess(
            BEAT_APP,
            ["beat", "-l", "INFO", "-S", scheduler, "-s", str(log_dir / f"{side}-{i}")],
            env,
            log_dir,
            f"{side}-{i}",
        ).start()
        for i in range(3)
    ]


def bench_duplicates(quick: bool) -> dict[str, Any]:
    minutes = 2.0 if quick else 10.0
    lease = 10.0 if quick else 30.0
    base = services.resolve_redis_base()
    claims = [services.RedisDbClaim(base), services.RedisDbClaim(base)]
    ours_url, plain_url = (c.url for c in claims)
    for url in (ours_url, plain_url):
        redis.Redis.from_url(url).flushdb()
    tmp = Path(tempfile.mkdtemp(prefix="safe-time-bench-dup-"))
    drains = [_Drain(ours_url), _Drain(plain_url)]
    for d in drains:
        d.start()
    ours = _beats("ours", ours_url, "celery_safe_time.SafeScheduler", tmp, {"safe_time_beat_lease": lease})
    plain = _beats("plain", plain_url, "celery.beat:PersistentScheduler", tmp, {})
    events: list[str] = []
    ours_client = redis.Redis.from_url(ours_url)
    start = time.time()
    duration = minutes * 60
    try:
        first = wait_for(lambda: leader_pid(ours_client), 60, message="a leader")
        leader = next(b for b in ours if b.pid == first)

        def at(fraction: float) -> None:
            while time.time() < start + duration * fraction:
                time.sleep(0.2)
                for c in claims:
                    c.refresh()

        at(0.2)
        leader.kill()
        plain[0].kill()
        events.append(f"t+{time.time() - start:.0f}s: kill -9 of the leader (ours) and of beat 0 (plain)")
        new = wait_for(lambda: (p := leader_pid(ours_client)) != first and p, lease * 2 + 20, message="a new leader")
        events.append(f"t+{time.time() - start:.0f}s: new leader acquired the lease (ours)")
        at(0.5)
        paused = next(b for b in ours if b.pid == new)
        paused.pause()
        plain[1].pause()
        pause_s = max(2 * lease, 0.15 * duration)
        events.append(
            f"t+{time.time() - start:.0f}s: SIGSTOP of the new leader (ours) and beat 1 (plain), {pause_s:.0f} s"
        )
        time.sleep(pause_s)
        paused.resume()
        plain[1].resume()
        events.append(f"t+{time.time() - start:.0f}s: SIGCONT: the paused processes resume")
        at(1.0)
    finally:
        for b in ours + plain:
            b.send(signal.SIGCONT)
            b.kill()
        time.sleep(2)
        for d in drains:
            d.stop.set()
            d.join(5)
        for url in (ours_url, plain_url):
            redis.Redis.from_url(url).flushdb()
        for c in claims:
            c.release()
    end = time.time()
    return {
        "minutes": minutes,
        "lease_s": lease,
        "events": events,
        "ours": _count_duplicates(drains[0].seen, start, end, by_header=True),
        "plain": _count_duplicates(drains[1].seen, start, end, by_header=False),
    }


def run(quick: bool, only: str | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {"quick": quick}
    if only in (None, "visibility"):
        results["visibility"] = bench_visibility(quick)
    if only in (None, "duplicates"):
        results["duplicates"] = bench_duplicates(quick)
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| measurement | celery-safe-time | plain Celery (same run) |", "|---|---|---|"]
    v = results.get("visibility")
    if v:
        lines.append(
            f"| executions per task{' on SQS' if v.get('broker') == 'sqs' else ''}, countdown {v['countdown_s']:g} s "
            f"> visibility_timeout {v['visibility_timeout_s']:g} s "
            f"({v['tasks']} tasks each) | mean {v['safe_mean']:.2f}, max {v['safe_max']} (SafeTask) "
            f"| mean {v['plain_mean']:.2f}, max {v['plain_max']} |"
        )
    d = results.get("duplicates")
    if d:
        o, p = d["ours"], d["plain"]
        lines.append(
            f"| duplicate slots, 3 beats, {d['minutes']:g} min, leader killed + one paused "
            f"| {o['duplicate_slots']} ({o['messages']} messages) | {p['duplicate_slots']} ({p['messages']} messages) |"
        )
        lines.append(
            f"| minutely crontab: messages / slots | {o['minutely_messages']} / {o['minutely_slots']} "
            f"| {p['minutely_messages']} / {p['minutely_slots']} |"
        )
        lines.append(
            f"| every-2 s entry: sends (one beat would send ~{o['interval_expected']}) | {o['interval_sends']} "
            f"| {p['interval_sends']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["visibility", "duplicates"])
    args = parser.parse_args(argv)
    results = run(args.quick, args.only)
    print(table(results))
    print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
