"""Rate strings (``"100/m"``) and the sliding-log rule every lock backend applies to them.

A rate ``N/period`` admits at most ``N`` calls that start within any ``period``: a sliding log keeps
the start time of each admitted call for one period, and a call is admitted while the log holds fewer
than ``N`` entries. A burst of up to ``N`` at once is allowed (an idle key has its whole allowance);
the next call then waits until the oldest entry is one period old. The Redis script
(``locks/lua/rate_take.lua``), the PostgreSQL function (``safe_time_rate_take_v1``) and the memory
backend (:func:`take`) follow the same rule on the backend's own clock.
"""

from __future__ import annotations

import bisect
import re
from typing import NamedTuple

__all__ = ["Rate", "RateTaken", "parse_rate", "take"]

#: Period units of a rate string, in seconds.
_UNITS = {
    "ms": 0.001,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
}

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*$")


class Rate(NamedTuple):
    """``limit`` calls per ``period`` seconds."""

    limit: int
    period: float

    def __str__(self) -> str:
        return f"{self.limit}/{self.period:g}s"

    @property
    def interval(self) -> float:
        """The mean time between calls at the full rate (``period / limit``)."""
        return self.period / self.limit


class RateTaken(NamedTuple):
    """What a backend's ``rate_take`` answered: whether the call is admitted, and if not, in how many
    seconds the log frees a place (``wait``); ``used`` is the log's length after the call."""

    admitted: bool
    wait: float
    used: int


def parse_rate(rate: str | Rate) -> Rate:
    """``"100/m"``, ``"20/s"``, ``"5/10s"``, ``"1/500ms"``, ``"1000/h"``, ``"10/day"`` -> :class:`Rate`.

    Raises ``ValueError`` naming the accepted forms for anything else (a count below 1, a period of 0).
    """
    if isinstance(rate, Rate):
        return rate
    match = _RATE.match(rate.lower()) if isinstance(rate, str) else None
    if match is None or match.group(3) not in _UNITS:
        raise ValueError(
            f"malformed rate {rate!r}: expected '<count>/<period>' such as '100/m', '20/s', '5/10s', "
            f"'1/500ms', '1000/h' or '10/d'"
        )
    limit = int(match.group(1))
    period = float(match.group(2) or 1) * _UNITS[match.group(3)]
    if limit < 1:
        raise ValueError(f"rate {rate!r} admits no call: the count must be at least 1")
    if not period > 0:
        raise ValueError(f"rate {rate!r} has an empty period")
    return Rate(limit, period)


def take(log: list[float], now: float, rate: Rate) -> RateTaken:
    """The sliding-log rule on ``log`` (sorted start times, changed in place) for a call at ``now``."""
    del log[: bisect.bisect_right(log, now - rate.period)]
    count = len(log)
    if count < rate.limit:
        bisect.insort(log, now)
        return RateTaken(True, 0.0, count + 1)
    # With a limit lowered since (a dynamic one), more than ``limit`` entries are live: the call waits
    # until enough of them are a period old that fewer than ``limit`` are left.
    frees = log[count - rate.limit] + rate.period
    return RateTaken(False, max(frees - now, 0.0), count)
