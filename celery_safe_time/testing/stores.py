"""The test stores: the in-memory store and the SQLite store, on one movable test clock."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ..clock import as_utc, local_time, to_datetime
from ..delays.backends.base import DelayRow
from ..delays.backends.memory import MemoryStore
from ..delays.backends.sql import SQLAlchemyStore

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection


class _MovableClock:
    """The forward-only test clock both test stores share: the store's own clock plus ``offset``,
    held still while the kit runs a call (:meth:`held`)."""

    offset: float = 0.0
    #: While held: the clock's reading (epoch seconds), which real time does not move.
    _held_at: float | None = None
    _holds: int = 0

    if TYPE_CHECKING:  # the store's own clock plus ``offset``; the mixin must not shadow it at runtime

        def now(self) -> datetime: ...

    def _own_time(self) -> float:
        """The store's own clock (epoch seconds), without the offset."""
        raise NotImplementedError

    def time(self) -> float:
        """The test clock as epoch seconds: the rate-limit windows' clock."""
        held = self._held_at
        return held if held is not None else local_time() + self.offset

    def _moved_now(self, own: datetime) -> datetime:
        """``now()`` of a store whose own clock reads ``own``: the held reading while held."""
        held = self._held_at
        return to_datetime(held) if held is not None else own + timedelta(seconds=self.offset)

    def advance(self, delta: timedelta | float) -> datetime:
        """Move the clock ``delta`` forward; returns the new now."""
        seconds = delta.total_seconds() if isinstance(delta, timedelta) else float(delta)
        if seconds < 0:
            raise ValueError(f"the test clock only moves forward, got {delta!r}")
        if self._held_at is not None:
            self._held_at += seconds
        else:
            self.offset += seconds
        return self.now()

    def advance_to(self, when: datetime) -> datetime:
        """Move the clock to ``when`` if that is later than now."""
        if self._held_at is not None:
            # Exactly ``when``: a due row is claimed at its due instant, not a rounding before it.
            self._held_at = max(self._held_at, as_utc(when).timestamp())
            return self.now()
        gap = (as_utc(when) - self.now()).total_seconds()
        if gap > 0:
            self.offset += gap
        return self.now()

    @contextlib.contextmanager
    def held(self) -> Iterator[datetime]:
        """Hold the clock still for the block: only ``advance``/``advance_to`` move it, not real time.

        The kit runs every call in such a block, so a call happens at one instant of the test clock
        (its due time, or the instant ``deliver`` was called) however long the machine takes to run
        it: what a rate limit decides, and the due time of what the call stores, are the same on a
        loaded machine as on an idle one. After the block the clock runs on from where it stood.
        """
        if self._holds == 0:
            self._held_at = self.now().timestamp()
        self._holds += 1
        try:
            yield self.now()
        finally:
            self._holds -= 1
            if self._holds == 0 and self._held_at is not None:
                self.offset = self._held_at - self._own_time()
                self._held_at = None


class TestStore(_MovableClock, MemoryStore):
    """The memory store with a clock a test moves forward (``advance``); it never moves back."""

    __test__ = False  # not a pytest test class

    def __init__(self, url: str = "memory://testing") -> None:
        super().__init__(url)
        self.offset = 0.0

    def _own_time(self) -> float:
        return local_time()

    def now(self) -> datetime:
        return self._moved_now(to_datetime(local_time()))

    def rows(self) -> list[DelayRow]:
        with self._lock:
            return sorted(self._rows.values(), key=lambda r: (r.due_at, r.id))


class TestSQLiteStore(_MovableClock, SQLAlchemyStore):
    """The SQL store on a temporary SQLite file, with a clock a test moves forward (``advance``).

    Every "now" of the store (claims, the delivery record's start and end, ``requeue_unstarted``) is
    SQLite's clock plus the offset, so due rows are found by the production claim query. ``close``
    deletes the file.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or tempfile.mkdtemp(prefix="safe-time-testing-")
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        super().__init__(f"sqlite:///{Path(self.directory) / 'delays.sqlite3'}")
        self.offset = 0.0

    def _own_time(self) -> float:
        return super().now().timestamp()

    def now(self) -> datetime:
        return self._moved_now(super().now())

    def _db_now(self, conn: Connection) -> datetime:
        return self._moved_now(super()._db_now(conn))

    def rows(self) -> list[DelayRow]:
        return self.list(limit=1_000_000)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)
