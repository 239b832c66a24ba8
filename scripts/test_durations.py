"""Write ``tests/durations.json`` from the ``--durations=0`` report of a whole ``make test`` run.

    make test PYTEST_ARGS="--durations=0" | tee /tmp/test.log
    .venv/bin/python scripts/test_durations.py /tmp/test.log

``tests/conftest.py`` starts the longest tests first (``make test`` hands tests out one by one as
workers free up), so a long test never starts last and holds the run's tail. Only tests of a second
or more are kept; a test missing from the file counts as short.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)(?:@[\w-]+)?$")
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main(log: str) -> None:
    seconds: dict[str, float] = collections.defaultdict(float)
    with open(log, encoding="utf-8") as lines:
        for line in lines:
            match = LINE.match(line)
            if match:
                seconds[match.group(2)] += float(match.group(1))
    kept = {test: round(took, 1) for test, took in sorted(seconds.items()) if took >= 1.0}
    OUT.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(kept)} tests of a second or more, {sum(kept.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
