"""Where a test run's CPU goes: sums ``SAFE_TIME_TEST_CPU_LOG`` lines (tests/conftest.py) by module.

SAFE_TIME_TEST_CPU_LOG=/tmp/cpu.jsonl make test
python scripts/cpu_report.py /tmp/cpu.jsonl [TOP]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str, top: int = 30) -> None:
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    tests = []
    with open(path, encoding="utf-8") as log:
        for line in log:
            record = json.loads(line)
            module = record["test"].split("::")[0]
            row = by_module[module]
            row[0] += record["own"]
            row[1] += record["children"]
            row[2] += record["wall"]
            row[3] += 1
            tests.append(record)
    own = sum(r[0] for r in by_module.values())
    children = sum(r[1] for r in by_module.values())
    print(
        f"{len(tests)} tests: {own:.0f} CPU-s in pytest processes, {children:.0f} CPU-s in the processes they started"
    )
    print(f"{'cpu-s':>8} {'own':>7} {'child':>7} {'wall-s':>8} {'tests':>5}  module")
    for module, (o, c, w, n) in sorted(by_module.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        print(f"{o + c:8.1f} {o:7.1f} {c:7.1f} {w:8.1f} {int(n):5d}  {module}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
