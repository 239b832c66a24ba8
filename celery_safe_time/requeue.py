"""Re-queue timing shared by the lock runtime and the stored-task delivery check."""

from __future__ import annotations

import random
from collections.abc import Callable


def jittered(retry_after: float, jitter: float, rand: Callable[[], float] = random.random) -> float:
    """``retry_after`` plus up to ``jitter`` seconds, so re-queued runs do not collide again."""
    return retry_after + jitter * rand()
