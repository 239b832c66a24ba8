"""Time authorities: Redis ``TIME``, the store database's ``now()`` and this host's clock.

Everything that decides *when* reads time through one of these, never ``time.time()``
directly, so beats, sweepers and workers on different machines agree on "now".

``local_time()`` honours ``SAFE_TIME_LOCAL_CLOCK_SKEW`` (seconds, may be negative): a
deliberate, documented way to run a process with a wrong local clock in tests and drills,
which is what the Redis/database clocks are there to make harmless.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import redis
from dateutil.parser import isoparse

from .exceptions import RedisUnavailable

logger = logging.getLogger(__name__)

SKEW_ENV = "SAFE_TIME_LOCAL_CLOCK_SKEW"
UTC = timezone.utc


def _local_skew() -> float:
    raw = os.environ.get(SKEW_ENV)
    if not raw:
        return 0.0
    try:
        return float(raw)
    except ValueError:
        logger.warning("ignoring %s=%r: not a number of seconds", SKEW_ENV, raw)
        return 0.0


_SKEW = _local_skew()


def local_time() -> float:
    """This host's wall clock as a UNIX timestamp (plus any injected skew)."""
    return time.time() + _SKEW


def to_datetime(ts: float) -> datetime:
    """UNIX timestamp -> aware UTC datetime."""
    return datetime.fromtimestamp(ts, UTC)


def as_utc(value: datetime | str | Any) -> datetime:
    """An aware UTC datetime from a datetime or an ISO 8601 string; naive values are UTC.

    Celery's rule for ``eta``/``expires``, and what the stores need for the values their drivers
    return (naive UTC from SQLite and MySQL, aware from PostgreSQL, text from SQLite's ``now``).
    """
    # dateutil's parser (Celery's, via maybe_iso8601) also takes "Z" and space separators on 3.10.
    parsed = isoparse(value) if isinstance(value, str) else value
    if not isinstance(parsed, datetime):
        raise TypeError(f"expected a datetime or ISO 8601 string, got {value!r}")
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


@dataclasses.dataclass(frozen=True)
class Offset:
    """``authority - local`` in seconds, measured with a round trip of ``rtt`` seconds."""

    offset: float
    rtt: float

    @property
    def uncertainty(self) -> float:
        return self.rtt / 2.0


@dataclasses.dataclass(frozen=True)
class Sync:
    """One Redis ``TIME`` reading: the server's time and this host's monotonic clock at the same
    instant (the middle of the round trip), and the wall-clock offset measured with it."""

    server: float
    monotonic: float
    offset: Offset


def measure_redis_sync(
    client: redis.Redis,
    *,
    samples: int = 3,
    local: Callable[[], float] = local_time,
    monotonic: Callable[[], float] = time.monotonic,
) -> Sync:
    """Read Redis ``TIME`` ``samples`` times; keeps the sample with the smallest RTT (:func:`measure_sync`)."""

    def read() -> float:
        try:
            seconds, micros = client.time()
        except redis.RedisError as exc:
            raise RedisUnavailable(f"cannot read Redis TIME: {exc}") from exc
        return float(seconds) + float(micros) / 1e6

    return measure_sync(read, samples=samples, local=local, monotonic=monotonic)


def measure_redis_offset(client: redis.Redis, *, samples: int = 3, local: Callable[[], float] = local_time) -> Offset:
    """Measure Redis ``TIME`` against the local wall clock (``checks``, beat's startup warning)."""
    return measure_redis_sync(client, samples=samples, local=local).offset


class ServerClock:
    """A server's clock as the shared clock, read cheaply between syncs with this host's monotonic clock.

    ``time()`` is the server time of the last sync plus the monotonic time since, re-synced every
    ``refresh`` seconds: a tick costs no round trip, and a step of this host's wall clock never moves
    beat's "now". The wall clock (``local``) only reports the offset. A failed refresh keeps
    interpolating from the last sync and logs. Subclasses say how a sync is measured (:meth:`measure`)
    and what a failed one raises (:attr:`unavailable`).
    """

    #: What :meth:`measure` raises when the server is down (a failed refresh is then survived).
    unavailable: tuple[type[Exception], ...] = (RedisUnavailable,)
    #: The name of the authority in log lines.
    authority = "server clock"

    def __init__(
        self,
        *,
        refresh: float = 30.0,
        local: Callable[[], float] = local_time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._refresh = refresh
        self._local = local
        self._monotonic = monotonic
        self._sync: Sync | None = None
        self._checked_at = float("-inf")  # monotonic time of the last sync attempt
        self._lock = threading.Lock()

    def measure(self) -> Sync:
        raise NotImplementedError

    @property
    def offset(self) -> Offset | None:
        """The server's time minus this host's wall clock at the last sync."""
        return None if self._sync is None else self._sync.offset

    def sync(self) -> Offset:
        """Measure now; raises one of :attr:`unavailable` when the server is down."""
        sync = self.measure()
        with self._lock:
            self._sync = sync
            self._checked_at = sync.monotonic
        return sync.offset

    def time(self) -> float:
        if self._sync is None or self._monotonic() - self._checked_at >= self._refresh:
            try:
                self.sync()
            except self.unavailable as exc:
                if self._sync is None:
                    raise
                logger.warning(
                    "keeping the last %s sync (interpolating with the monotonic clock): %s", self.authority, exc
                )
                self._checked_at = self._monotonic()
        sync = self._sync
        assert sync is not None
        return sync.server + (self._monotonic() - sync.monotonic)


def measure_sync(
    read: Callable[[], float],
    *,
    samples: int = 3,
    local: Callable[[], float] = local_time,
    monotonic: Callable[[], float] = time.monotonic,
) -> Sync:
    """Read a server's clock (``read``: its UNIX time) ``samples`` times; keeps the smallest RTT.

    The RTT is timed on the monotonic clock, so a wall-clock step during the measurement cannot
    make it negative or huge; the wall clock only gives the offset that checks report.
    """
    best: Sync | None = None
    for _ in range(max(1, samples)):
        wall_before, mono_before = local(), monotonic()
        server = read()
        mono_after, wall_after = monotonic(), local()
        sample = Sync(
            server=server,
            monotonic=(mono_before + mono_after) / 2.0,
            offset=Offset(offset=server - (wall_before + wall_after) / 2.0, rtt=mono_after - mono_before),
        )
        if best is None or sample.offset.rtt < best.offset.rtt:
            best = sample
    assert best is not None
    return best


class RedisClock(ServerClock):
    """Redis ``TIME`` as the shared clock (see :class:`ServerClock`)."""

    authority = "Redis TIME"

    def __init__(
        self,
        client: redis.Redis,
        *,
        refresh: float = 30.0,
        local: Callable[[], float] = local_time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(refresh=refresh, local=local, monotonic=monotonic)
        self._client = client

    def measure(self) -> Sync:
        return measure_redis_sync(self._client, local=self._local, monotonic=self._monotonic)
