"""``make demo`` entry point (the full scenario arrives with the demo issue)."""

from __future__ import annotations

import sys


def main() -> int:
    print("celery-safe-time demo: coming with the demo issue (#6). Run `make test` meanwhile.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
