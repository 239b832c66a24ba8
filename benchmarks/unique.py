"""Unique tasks (issue 17) beside celery-once and celery-singleton, same run, private ``redis-server``.

``python -m benchmarks.unique [--quick] [enqueue|compare]``; ``run(quick, part) -> dict``.

- ``enqueue``: the caller's cost of one ``apply_async`` (median ms, no worker): plain ``delay()`` of a
  SafeTask without ``unique=``, a unique task with a new key each call (the key is taken) and with a
  held key (the conflict path hands back the holder), and the same two for celery-once and
  celery-singleton; the kinds are interleaved in rounds so load drifts hit them alike. One Redis PING
  from the same client is the round-trip yardstick.
- ``compare``: the same four scenarios with each library on a real prefork worker, the same ttl for all
  (``TTL``): kill -9 of the worker mid-task, revoke of a queued copy (countdown 3 s), a task that
  retries itself once (countdown 3 s), a 2 s hard time limit. Measured: is a key left behind right
  after the event, and for how long a new ``delay()`` of the same key is still refused (probed every
  ``PROBE`` s, up to ``TTL + 10`` s), plus, for the retry, whether the retry ran and whether a duplicate
  was queued while it waited.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from benchmarks.common import PrivateRedis

ROOT = Path(__file__).resolve().parents[1]
TTL = 15.0
PROBE = 0.25
LIBS = ("ours", "once", "singleton")
LIB_NAMES = {"ours": "celery-safe-time", "once": "celery-once 3.0.1", "singleton": "celery-singleton 0.3.1"}


def _load_app(url: str) -> ModuleType:
    os.environ["SAFE_TIME_BENCH_BROKER_URL"] = url
    os.environ["SAFE_TIME_BENCH_UNIQUE_TTL"] = str(TTL)
    return importlib.import_module("benchmarks.unique_app")


# --- enqueue cost ---------------------------------------------------------------------------------


def _enqueue(quick: bool) -> dict[str, Any]:
    server = PrivateRedis("unique")  # broker, results and every library's keys
    try:
        mod = _load_app(server.url)
        tasks = mod.TASKS
        held = 10**9  # one key per library taken once, then every call of it conflicts
        for lib in LIBS:
            tasks[lib]["hold"].delay(held)
        calls: dict[str, Callable[[int], Any]] = {
            "plain delay()": lambda n: tasks["ours"]["plain"].delay(n),
            "celery-safe-time, new key": lambda n: tasks["ours"]["hold"].delay(n),
            "celery-safe-time, held key": lambda n: tasks["ours"]["hold"].delay(held),
            "celery-once, new key": lambda n: tasks["once"]["hold"].delay(n),
            "celery-once, held key": lambda n: tasks["once"]["hold"].delay(held),
            "celery-singleton, new key": lambda n: tasks["singleton"]["hold"].delay(n),
            "celery-singleton, held key": lambda n: tasks["singleton"]["hold"].delay(held),
            "Redis PING (round trip)": lambda n: server.client.ping(),
        }
        rounds, per_round = (5, 40) if quick else (20, 100)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        n = 0
        for call in calls.values():  # warm up connections and script caches
            for _ in range(5):
                n += 1
                call(n)
        for _ in range(rounds):
            for name, call in calls.items():
                for _ in range(per_round):
                    n += 1
                    began = time.perf_counter()
                    call(n)
                    samples[name].append((time.perf_counter() - began) * 1000.0)
        base = statistics.median(samples["plain delay()"])
        return {
            "calls_per_kind": rounds * per_round,
            "load": os.getloadavg(),
            "kinds": {
                name: {
                    "median_ms": round(statistics.median(values), 3),
                    "p90_ms": round(sorted(values)[int(len(values) * 0.9)], 3),
                    "vs_plain": round(statistics.median(values) / base, 2),
                }
                for name, values in samples.items()
            },
        }
    finally:
        server.close()


# --- leftovers after faults -----------------------------------------------------------------------


class _Worker:
    def __init__(self, url: str, log: Path) -> None:
        env = {
            **os.environ,
            "SAFE_TIME_BENCH_BROKER_URL": url,
            "SAFE_TIME_BENCH_UNIQUE_TTL": str(TTL),
            "PYTHONPATH": str(ROOT),
        }
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "benchmarks.unique_app", "worker", "-l", "WARNING",
                 "-c", "2", "-P", "prefork", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(log.parent),
            )  # fmt: skip
        self.log = log

    def wait_ready(self, app: Any) -> None:
        deadline = time.monotonic() + 90
        while not app.control.ping(timeout=0.5):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("benchmark worker did not start:\n" + self.log.read_text()[-3000:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@contextlib.contextmanager
def _worker(server: PrivateRedis, app: Any, log: Path) -> Iterator[_Worker]:
    worker = _Worker(server.url, log)
    try:
        worker.wait_ready(app)
        yield worker
    finally:
        worker.kill()


def _starts(client: redis.Redis, lib: str, name: str) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange("bench:unique:starts", 0, -1)]
    return [s for s in found if s["lib"] == lib and s["name"] == name]


def _wait(predicate: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _queued(task: Any, n: int, known: set[str]) -> str | None:
    """Try one more call of key ``n``: the new task id when it was queued, None when refused."""
    result = task.apply_async((n,), {"seconds": 0.0})
    task_id = getattr(result, "id", None)
    if task_id is None or task_id in known:
        return None
    return str(task_id)


def _blocked_for(task: Any, n: int, known: set[str], since: float) -> dict[str, Any]:
    """How long after ``since`` a new call of the key is still refused (probed every PROBE s)."""
    cap = TTL + 10.0
    while True:
        now = time.time()
        if _queued(task, n, known) is not None:
            return {"blocked_s": round(max(0.0, now - since), 2), "capped": False}
        if now - since > cap:
            return {"blocked_s": round(now - since, 2), "capped": True}
        time.sleep(PROBE)


def _left(client: redis.Redis, pattern: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=pattern))


def _scenario(server: PrivateRedis, mod: ModuleType, lib: str, scenario: str, log: Path) -> dict[str, Any]:
    client, app, tasks = server.client, mod.app, mod.TASKS[lib]
    pattern = mod.KEY_PATTERNS[lib]
    client.flushdb()
    out: dict[str, Any] = {}
    with _worker(server, app, log) as worker:
        if scenario == "kill -9 mid-task":
            first = tasks["hold"].apply_async((1,), {"seconds": 60.0})
            _wait(lambda: _starts(client, lib, "hold"), 60)
            worker.kill()
            event = time.time()
            out["left"] = _left(client, pattern)
            out |= _blocked_for(tasks["hold"], 1, {first.id}, event)
        elif scenario == "revoke of a queued copy":
            first = tasks["hold"].apply_async((2,), {"seconds": 0.0}, countdown=3)
            first.revoke()
            event = time.time()
            time.sleep(0.2)
            out["left"] = _left(client, pattern)
            out |= _blocked_for(tasks["hold"], 2, {first.id}, event)
            out["ran"] = any(s["task_id"] == first.id for s in _starts(client, lib, "hold"))
        elif scenario == "retry (countdown 3 s)":
            first = tasks["flaky"].apply_async((3,), {"seconds": 0.0})
            _wait(lambda: _starts(client, lib, "flaky"), 60)
            time.sleep(0.5)
            duplicate = _queued(tasks["flaky"], 3, {first.id})
            out["duplicate_during_wait"] = duplicate is not None
            retried = _wait(
                lambda: [s for s in _starts(client, lib, "flaky") if s["task_id"] == first.id and s["retries"] == 1],
                15,
            )
            out["retry_ran"] = bool(retried)
            event = time.time()
            time.sleep(0.5)
            out["left"] = _left(client, pattern)
            known = {first.id} | ({duplicate} if duplicate else set())
            out |= _blocked_for(tasks["flaky"], 3, known, event)
        elif scenario == "hard time limit (2 s)":
            first = tasks["limited"].apply_async((4,), {"seconds": 30.0})
            [start] = _wait(lambda: _starts(client, lib, "limited"), 60)
            event = start["at"] + mod.HARD_LIMIT
            _wait(lambda: first.state == "FAILURE", 20)
            time.sleep(0.3)
            out["left"] = _left(client, pattern)
            out |= _blocked_for(tasks["limited"], 4, {first.id}, event)
    return out


SCENARIOS = ("kill -9 mid-task", "revoke of a queued copy", "retry (countdown 3 s)", "hard time limit (2 s)")


def _compare(quick: bool) -> dict[str, Any]:
    server = PrivateRedis("unique")  # broker, results and every library's keys
    try:
        mod = _load_app(server.url)
        log = Path(server.dir) / "worker.log"
        results: dict[str, dict[str, Any]] = {}
        load_before = os.getloadavg()
        for scenario in SCENARIOS:
            for lib in LIBS:
                try:
                    results.setdefault(scenario, {})[lib] = _scenario(server, mod, lib, scenario, log)
                except Exception as exc:  # one library's failure must not hide the others' numbers
                    results.setdefault(scenario, {})[lib] = {"error": f"{exc.__class__.__name__}: {exc}"}
        return {"ttl_s": TTL, "probe_s": PROBE, "load_before": load_before, "load_after": os.getloadavg(), **results}
    finally:
        server.close()


def run(quick: bool = False, part: str = "enqueue") -> dict[str, Any]:
    if part == "compare":
        return {"compare": _compare(quick)}
    return {"enqueue": _enqueue(quick)}


# --- report ---------------------------------------------------------------------------------------


def _cell(r: dict[str, Any], scenario: str) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    left = "key left" if r.get("left") else "no key left"
    blocked = f"refused >= {r['blocked_s']:g} s (cap)" if r.get("capped") else f"refused {r['blocked_s']:g} s"
    if scenario.startswith("retry"):
        extra = [
            "retry ran" if r.get("retry_ran") else "**retry never ran**",
            "**duplicate queued during the wait**" if r.get("duplicate_during_wait") else "no duplicate",
        ]
        return "; ".join([*extra, f"after it: {left}, {blocked}"])
    if scenario.startswith("revoke") and r.get("ran"):
        return f"{left}, {blocked}; **the revoked copy ran**"
    return f"{left}, {blocked}"


def markdown(result: dict[str, Any]) -> str:
    lines: list[str] = []
    e = result.get("enqueue")
    if e:
        lines += [
            f"Enqueue cost per call, median of {e['calls_per_kind']} calls each, interleaved, same run "
            f"(load average {e['load'][0]:.2f}):",
            "",
            "| call | median ms | p90 ms | vs plain delay() |",
            "|---|---|---|---|",
        ]
        for name, k in e["kinds"].items():
            lines.append(f"| {name} | {k['median_ms']:.3f} | {k['p90_ms']:.3f} | {k['vs_plain']:.2f}x |")
        lines.append("")
    c = result.get("compare")
    if c:
        lines += [
            f"After a fault, same run, same ttl for all three ({c['ttl_s']:g} s), probed every {c['probe_s']:g} s "
            f'(load average {c["load_before"][0]:.2f} before, {c["load_after"][0]:.2f} after). "refused N s": '
            "for how long after the event a new `delay()` of the same key was still refused:",
            "",
            "| scenario | " + " | ".join(LIB_NAMES[lib] for lib in LIBS) + " |",
            "|---|" + "---|" * len(LIBS),
        ]
        for scenario in SCENARIOS:
            row = c.get(scenario, {})
            lines.append(f"| {scenario} | " + " | ".join(_cell(row.get(lib, {}), scenario) for lib in LIBS) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("part", nargs="?", default="both", choices=["enqueue", "compare", "both"])
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    if args.part in ("enqueue", "both"):
        result |= run(args.quick, "enqueue")
    if args.part in ("compare", "both"):
        result |= run(args.quick, "compare")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
