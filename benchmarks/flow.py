"""Flow control: a global ``rate_limit`` across two workers against Celery's per-worker ``rate_limit``,
and the cost per call against a bare task.

``python -m benchmarks.flow [--quick] [--producer client|beat]`` prints a markdown table; ``run(quick,
producer) -> dict`` returns the numbers. Against a private ``redis-server`` (broker and limits) and two
prefork workers (concurrency 4 each, the same two for both kinds), in one run:

- accuracy: a producer sends calls at 1.5 x the limit for the run's length; the achieved total is the
  number of starts in the first ``seconds`` after the first start (``RATE x seconds`` expected: 600 in
  the full run's 30 s), the achieved global rate that total over ``seconds``. The producer is this
  process (``client``, paced evenly; the quick run's) or two ``SafeScheduler`` beats (``beat``, the full
  run's default): one entry a second, fired by whichever beat leads, whose task fans out 1.5 x the
  limit in calls (a burst each second). The global
  limit is ``@rate_limit("bench:global", "N/s")``; Celery's is ``rate_limit="N/2/s"`` on each of the
  two workers (what a user sets to share N/s between two workers). Also: the most starts in any one
  second window (the limit allows N).
- cost: direct calls in this process (no broker), one key: ``@rate_limit`` with a limit no call
  reaches, against the same bare function; the difference is the backend round trip.
"""

from __future__ import annotations

import argparse
import itertools
import os
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
WORKERS = 2
BEATS = 2
RATE = 20


class _Services:
    """A private redis-server and two workers of ``benchmarks.flow_app``."""

    def __init__(self) -> None:
        self.redis = PrivateRedis("flow")
        self.dir, self.url, self.client = self.redis.dir, self.redis.url, self.redis.client
        self.workers: list[subprocess.Popen[bytes]] = []

    def start_workers(self) -> None:
        env = self.env()
        for n in range(WORKERS):
            args = [sys.executable, "-m", "celery", "-A", "benchmarks.flow_app", "worker", "-l", "WARNING",
                    "-n", f"flow{n}@%h", "-c", str(CONCURRENCY), "-P", "prefork", "-Q", "celery,flow-fanout",
                    "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
            with open(Path(self.dir) / f"worker{n}.log", "ab") as log:
                worker = subprocess.Popen(
                    args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir
                )
            self.workers.append(worker)
        app = Celery("bench-client", broker=self.url, set_as_current=False)
        deadline = time.monotonic() + 60
        while len(app.control.ping(timeout=0.5)) < WORKERS:
            if time.monotonic() > deadline:
                raise RuntimeError("benchmark workers did not start")
        app.close()

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SAFE_TIME_BENCH_BROKER_URL": self.url,
            "SAFE_TIME_BENCH_FLOW_RATE": str(RATE),
            "SAFE_TIME_BENCH_FLOW_PER_WORKER": f"{RATE / WORKERS:g}",
            "PYTHONPATH": str(ROOT),
        }

    def start_beats(self, task: str, count: int = BEATS) -> list[subprocess.Popen[bytes]]:
        """``count`` SafeScheduler beats whose one entry fans out 1.5 x RATE calls of ``task`` a second."""
        env = {
            **self.env(),
            "SAFE_TIME_BENCH_FLOW_FANOUT_TASK": task,
            "SAFE_TIME_BENCH_FLOW_FANOUT_PER_SECOND": str(int(RATE * 1.5)),
        }
        beats = []
        for n in range(count):
            args = [sys.executable, "-m", "celery", "-A", "benchmarks.flow_app", "beat", "-l", "INFO",
                    "-S", "celery_safe_time.SafeScheduler", "-s", str(Path(self.dir) / f"beat{n}-schedule"),
                    "--max-interval", "1"]  # fmt: skip
            with open(Path(self.dir) / f"beat{n}.log", "ab") as log:
                beats.append(
                    subprocess.Popen(
                        args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir
                    )
                )
        return beats

    @staticmethod
    def stop(procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        for worker in self.workers:
            try:
                os.killpg(worker.pid, signal.SIGTERM)
                worker.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(worker.pid, signal.SIGKILL)
        self.redis.close()


def _most_in_window(starts: list[float], window: float) -> int:
    ordered = sorted(starts)
    best, j = 0, 0
    for i, start in enumerate(ordered):
        while ordered[j] <= start - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def _accuracy(services: _Services, kind: str, task: str, seconds: float, producer: str = "client") -> dict[str, Any]:
    """Send 1.5 x RATE calls per second for ``seconds`` + 2 s; count the starts of the first ``seconds``."""
    services.client.delete("bench:flow:starts", "bench:flow:fanouts")
    if producer == "beat":
        beats = services.start_beats(task)
        try:
            time.sleep(seconds + 2)
        finally:
            services.stop(beats)
    else:
        app = Celery("bench-client", broker=services.url, set_as_current=False)
        pace = 1.0 / (RATE * 1.5)
        total = int((seconds + 2) * RATE * 1.5)
        began = time.monotonic()
        for n in range(total):
            app.send_task(task, args=(n,))
            delay = began + (n + 1) * pace - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        app.close()

    def starts(label: str) -> list[float]:
        raw: list[bytes] = services.client.lrange("bench:flow:starts", 0, -1)  # type: ignore[assignment]
        return [float(line.split()[1]) for line in (r.decode() for r in raw) if line.split()[0] == label]

    def window_closed() -> bool:
        # The first ``seconds`` are over once a later start is recorded (then 0.5 s for the records of
        # other processes still on their way).
        ran = starts(kind)
        return len(ran) >= RATE * seconds + 1 or (bool(ran) and max(ran) >= min(ran) + seconds)

    deadline = time.monotonic() + seconds * 2 + 30
    while not window_closed() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    ran = sorted(starts(kind))
    first = ran[0]
    in_window = sum(1 for s in ran if s < first + seconds)
    achieved = in_window / seconds
    result = {
        "seconds": seconds,
        "total": in_window,
        "expected": int(RATE * seconds),
        "total_error_pct": (in_window - RATE * seconds) / (RATE * seconds) * 100,
        "achieved_per_s": achieved,
        "error_pct": (achieved - RATE) / RATE * 100,
        "most_in_1s": _most_in_window(ran[: in_window + RATE], 1.0),
    }
    if producer == "beat":
        raw: list[bytes] = services.client.lrange("bench:flow:fanouts", 0, -1)  # type: ignore[assignment]
        fired = sorted(float(r.split()[0]) for r in raw)
        result["fanouts"] = len(fired)
        result["fanout_gaps_max"] = max((b - a for a, b in itertools.pairwise(fired)), default=0.0)
        result["produced_in_window"] = int(RATE * 1.5) * sum(1 for f in fired if first <= f < first + seconds)
    if kind == "global":
        admitted = sorted(starts("admitted"))
        result["most_in_1s_backend_clock"] = _most_in_window(admitted, 1.0)
    # Let the rest run out before the next kind (calls still queued would count for nobody).
    drained = time.monotonic() + 60
    while time.monotonic() < drained:
        before = services.client.llen("bench:flow:starts")
        time.sleep(1.5)
        if services.client.llen("bench:flow:starts") == before:
            break
    return result


def _cost(per_kind: int) -> dict[str, Any]:
    """Direct calls, one key: microseconds per call, bare vs ``rate_limit`` on the private Redis."""
    from celery_safe_time import rate_limit

    services = _Services()
    try:
        app = Celery("bench-cost", broker=services.url, set_as_current=False)
        app.conf.update(safe_time_store_url="memory://bench-cost")

        @app.task(shared=False)
        def bare(n: int) -> int:
            return n

        @app.task(shared=False)
        @rate_limit("cost:{n}", "100000000/s")
        def limited(n: int) -> int:
            return n

        timings: dict[str, list[float]] = {"bare": [], "rate_limit": []}
        for _ in range(200):
            bare(1)
            limited(1)
        for _round in range(5):
            for name, func in (("bare", bare), ("rate_limit", limited)):
                began = time.perf_counter()
                for _ in range(per_kind // 5):
                    func(1)
                timings[name].append((time.perf_counter() - began) / (per_kind // 5) * 1e6)
        out = {name: statistics.median(values) for name, values in timings.items()}
        out["overhead_us"] = out["rate_limit"] - out["bare"]
        return out
    finally:
        services.close()


def run(quick: bool = False, producer: str | None = None) -> dict[str, Any]:
    seconds = 5.0 if quick else 30.0
    producer = producer or ("client" if quick else "beat")
    services = _Services()
    try:
        services.start_workers()
        accuracy = {
            "global": _accuracy(services, "global", "flow.global", seconds, producer),
            "celery": _accuracy(services, "celery", "flow.celery", seconds, producer),
        }
    finally:
        services.close()
    return {
        "rate": RATE,
        "producer": producer,
        "workers": WORKERS,
        "concurrency": CONCURRENCY,
        "accuracy": accuracy,
        "cost": _cost(2000 if quick else 10000),
        "load": os.getloadavg(),
    }


def markdown(result: dict[str, Any]) -> str:
    rate, workers = result["rate"], result["workers"]
    a = result["accuracy"]
    g, c = a["global"], a["celery"]
    producer = {
        "beat": f"{BEATS} SafeScheduler beats, an entry a second fanning out 1.5 x the limit",
        "client": "one client sending 1.5 x the limit, evenly paced",
    }.get(result.get("producer", "client"), "?")
    lines = [
        f"A limit of {rate}/s over {workers} prefork workers (concurrency {result['concurrency']} each), the "
        f"same workers and the same producer ({producer}) for both, {g['seconds']:g} s each, same run "
        f"(load average {result['load'][0]:.2f}):",
        "",
        "| | runs in the window (expected) | error | achieved global rate | most starts in any 1 s |",
        "|---|---|---|---|---|",
        f'| `@rate_limit(key, "{rate}/s")` (global) | {g["total"]} ({g["expected"]}) | {g["total_error_pct"]:+.1f}% | '
        f"{g['achieved_per_s']:.2f}/s | {g['most_in_1s']} (backend clock: {g.get('most_in_1s_backend_clock', '?')}) |",
        f'| Celery `rate_limit="{rate / workers:g}/s"` on each worker | {c["total"]} ({c["expected"]}) | '
        f"{c['total_error_pct']:+.1f}% | {c['achieved_per_s']:.2f}/s | {c['most_in_1s']} |",
        "",
    ]
    if "fanouts" in g:
        lines += [
            "Calls produced within each window by the beats' fan-outs (the limit needs at least the expected "
            f"total): global {g['produced_in_window']} ({g['fanouts']} fan-outs in all, largest gap "
            f"{g['fanout_gaps_max']:.1f} s), Celery {c['produced_in_window']} ({c['fanouts']} fan-outs, largest "
            f"gap {c['fanout_gaps_max']:.1f} s).",
            "",
        ]
    cost = result["cost"]
    lines += [
        "Cost per call, direct calls in one process, one key, median of 5 rounds:",
        "",
        "| | µs per call |",
        "|---|---|",
        f"| bare task | {cost['bare']:.1f} |",
        f"| `@rate_limit` (admitted, Redis) | {cost['rate_limit']:.1f} (+{cost['overhead_us']:.1f}) |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--producer",
        choices=("client", "beat"),
        help="who sends the calls: this process, evenly paced (the quick run's default), or two "
        "SafeScheduler beats fanning out a burst each second (the full run's default)",
    )
    args = parser.parse_args(argv)
    print(markdown(run(args.quick, args.producer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
