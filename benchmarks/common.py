"""Shared helpers for the benchmark scripts: timing stats, machine description, result rows."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
from importlib import metadata
from typing import Any


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
