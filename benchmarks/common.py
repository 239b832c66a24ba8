"""Shared helpers for the benchmark scripts: timing stats, machine description, result rows."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata
from typing import Any

import redis


@dataclasses.dataclass
class Row:
    """One line of the benchmark table: ours next to its baseline from the same run."""

    what: str
    ours: float | None
    baseline: float | None
    unit: str
    goal: str
    met: bool | None
    baseline_name: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.baseline in (None, 0):
            return None
        return self.ours / self.baseline  # type: ignore[operator]

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ratio"] = self.ratio
        return data


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "celery": version("celery"),
        "kombu": version("kombu"),
        "redis-py": version("redis"),
        "django-celery-beat": version("django-celery-beat"),
        "celery-redbeat": version("celery-redbeat"),
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


class PrivateRedis:
    """A redis-server of one benchmark's own: a free loopback port, no persistence, a temporary directory
    (``dir``, also a place for the benchmark's worker logs); ``close`` stops it and removes the directory."""

    def __init__(self, benchmark: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(f"benchmarks.{benchmark} needs redis-server (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix=f"safe-time-bench-{benchmark}-")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table: ``header``, its rule (``align``: a letter a column, ``r`` right-aligned, any
    other or none left-aligned), then a line a row, each cell as ``str`` writes it (a ``|`` escaped)."""
    rule = "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header))[: len(header)])
    lines = ["| " + " | ".join(header) + " |", "|" + rule]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def by_size(results: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(entry count, its measurements) of the results keyed by an entry count, in their order; the
    other keys (settings, the runs beside) passed over."""
    return ((int(key), r) for key, r in results.items() if key.isdigit())


def print_report(table: str, results: Any) -> int:
    """A benchmark's output: its markdown table (what ``benchmarks.run`` collects), a blank line, then
    the whole results as JSON. Returns the exit status."""
    print(table)
    print()
    print(json.dumps(results, indent=2))
    return 0
