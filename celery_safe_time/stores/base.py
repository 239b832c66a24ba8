"""The delayed-task store seam: what every backend (SQLAlchemy, Django ORM, memory) provides."""

from __future__ import annotations

import abc
from datetime import datetime


class DelayStore(abc.ABC):
    """A durable table of delayed tasks keyed by task id, with its own clock (``now()``)."""

    #: The URL it was built from (masked before it is ever logged).
    url: str = ""

    @abc.abstractmethod
    def now(self) -> datetime:
        """The database's current time as an aware UTC datetime: the clock that decides "due"."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`~celery_safe_time.exceptions.StoreError` unless the store answers."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (called at process shutdown and by tests)."""
