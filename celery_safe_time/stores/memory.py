"""In-memory store for unit tests and examples: same contract, nothing durable."""

from __future__ import annotations

import threading
from datetime import datetime

from ..clock import local_time, to_datetime
from .base import DelayStore


class MemoryStore(DelayStore):
    """Keeps rows in a dict guarded by a lock; its clock is the local clock (or one you pass)."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._lock = threading.RLock()

    def now(self) -> datetime:
        return to_datetime(local_time())

    def ping(self) -> None:
        return None
