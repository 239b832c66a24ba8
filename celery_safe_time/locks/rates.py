"""Rate strings (``"100/m"``) and the sliding-log rule every lock backend applies to them.

A rate ``N/period`` admits at most ``N`` calls that start within any ``period``: a sliding log keeps
the start time of each admitted call for one period, and a call is admitted while fewer than ``N``
entries are in it. A burst of up to ``N`` at once is allowed (an idle key has its whole allowance).

A call that does not fit gets a reservation instead of a refusal: an entry at the first instant a
place frees after every earlier reservation (the oldest entry that must age out, plus one period),
and the call is re-queued to that instant under the same token. Waiting calls of one key therefore
come back one after another, each to a place of its own, rather than all at the instant the first
place frees. A call that comes back is admitted if its window still has room (a call that started
late is recorded at its real start, so the limit holds for real start times); if it does not, its
reservation moves to the instant the start that blocks it ages out, keeping its place in line. An
admitted entry takes a member of its own (``<token>@<start>``), so a later delivery carrying the same
token (a retry) is a new call.

The Redis script (``locks/lua/rate_take.lua``), the PostgreSQL function (``safe_time_rate_take_v1``)
and the memory backend (:func:`take`) follow the same rule on the backend's own clock.
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
    seconds its reservation is due (``wait``); ``used`` is the number of entries (reservations
    included) in the log after the call; ``at`` is when the backend answered, on its clock (epoch
    seconds): an admitted call's recorded start."""

    admitted: bool
    wait: float
    used: int
    at: float = 0.0


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


def admitted_member(token: str, now: float) -> str:
    """The log member of a call admitted at ``now``: no longer its token, which a retry carries again."""
    return f"{token}@{now:.6f}"


def take(log: list[tuple[float, str]], now: float, rate: Rate, token: str, *, reserve: bool = True) -> RateTaken:
    """The sliding-log rule on ``log`` (sorted (time, member) pairs, changed in place) for a call at
    ``now`` carrying ``token`` (its reservation's member, if it has one). Without ``reserve`` a call
    that does not fit only learns its wait (a direct call, which cannot come back)."""
    del log[: bisect.bisect_right(log, (now - rate.period, "\uffff"))]
    own = next((i for i, (_, member) in enumerate(log) if member == token), None)
    if own is not None:
        reserved = log[own][0]
        if reserved > now:
            return RateTaken(False, reserved - now, len(log), now)
        del log[own]
        started = bisect.bisect_right(log, (now, "\uffff"))
        if started < rate.limit:
            bisect.insort(log, (now, admitted_member(token, now)))
            return RateTaken(True, 0.0, len(log), now)
        # Due, but a call ahead started late and its window is still full: the call keeps its place
        # in line, due again when the start that blocks it ages out (moments away, as a rule).
        due = log[started - rate.limit][0] + rate.period
        bisect.insort(log, (due, token))
        return RateTaken(False, due - now, len(log), now)
    count = len(log)
    if count < rate.limit:
        bisect.insort(log, (now, admitted_member(token, now)))
        return RateTaken(True, 0.0, count + 1, now)
    # The first instant a place frees after every reservation: the entry ``limit`` places from the
    # end ages out then. (With a limit lowered since, more than ``limit`` entries are live and the
    # place frees once enough of them aged out.)
    due = log[count - rate.limit][0] + rate.period
    if not reserve:
        return RateTaken(False, due - now, count, now)
    bisect.insort(log, (due, token))
    return RateTaken(False, due - now, count + 1, now)
