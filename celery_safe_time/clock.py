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


def measure_redis_offset(client: redis.Redis, *, samples: int = 3, local: Callable[[], float] = local_time) -> Offset:
    """Measure Redis ``TIME`` against the local clock; keeps the sample with the smallest RTT."""
    best: Offset | None = None
    for _ in range(max(1, samples)):
        before = local()
        try:
            seconds, micros = client.time()
        except redis.RedisError as exc:
            raise RedisUnavailable(f"cannot read Redis TIME: {exc}") from exc
        after = local()
        server = float(seconds) + float(micros) / 1e6
        sample = Offset(offset=server - (before + after) / 2.0, rtt=after - before)
        if best is None or sample.rtt < best.rtt:
            best = sample
    assert best is not None
    return best


class RedisClock:
    """Redis ``TIME`` as the shared clock, read cheaply as local time plus a measured offset.

    The offset is re-measured every ``refresh`` seconds, so a tick costs no round trip while
    the processes still agree within the measured RTT. A failed refresh keeps the last offset
    (the local clock does not jump) and logs once.
    """

    def __init__(self, client: redis.Redis, *, refresh: float = 30.0, local: Callable[[], float] = local_time) -> None:
        self._client = client
        self._refresh = refresh
        self._local = local
        self._offset: Offset | None = None
        self._measured_at = float("-inf")
        self._lock = threading.Lock()

    @property
    def offset(self) -> Offset | None:
        return self._offset

    def sync(self) -> Offset:
        """Measure the offset now; raises :class:`RedisUnavailable` when Redis is down."""
        offset = measure_redis_offset(self._client, local=self._local)
        with self._lock:
            self._offset = offset
            self._measured_at = self._local()
        return offset

    def time(self) -> float:
        now = self._local()
        if self._offset is None or now - self._measured_at >= self._refresh:
            try:
                self.sync()
            except RedisUnavailable as exc:
                if self._offset is None:
                    raise
                logger.warning("keeping last Redis clock offset %.3fs: %s", self._offset.offset, exc)
                self._measured_at = now
            now = self._local()
        assert self._offset is not None
        return now + self._offset.offset
