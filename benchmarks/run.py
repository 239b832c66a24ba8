"""``make bench`` entry point: runs every benchmark module and writes docs/benchmarks.md."""

from __future__ import annotations

import sys


def main() -> int:
    print("benchmarks: none yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
