"""Rate strings (``"100/m"``) and the sliding-log rule every lock backend applies to them (docs/flow-control.md).

At most ``N`` calls start within any ``period``. Two logs per key: the *starts* log holds the real
start of every call admitted within the last period (admission needs fewer than ``N`` there, so the
limit holds for real starts); the *line* holds places, a reservation at its due instant or an
admitted call at the place it was given. New places are counted on the line, not from real starts,
so calls that come back a delivery latency late do not push every later place back (a full key
would otherwise run ``N`` calls per ``period + latency``). An admitted entry's member is
``<token>@<start>``, so a retry carrying the same token is a new call.

``locks/lua/rate_take.lua``, the PostgreSQL ``safe_time_rate_admit`` and :func:`take` (memory)
follow this rule on the backend's own clock.
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


def take(
    line: list[tuple[float, str]],
    starts: list[tuple[float, str]],
    now: float,
    rate: Rate,
    token: str,
    *,
    reserve: bool = True,
) -> RateTaken:
    """The rule on one key's ``line`` and ``starts`` (sorted (time, member) pairs, changed in place)
    for a call at ``now`` carrying ``token`` (its reservation's member, if it has one). Without
    ``reserve`` a call that does not fit only learns its wait (a direct call, which cannot come back)."""
    floor = (now - rate.period, "\uffff")
    del line[: bisect.bisect_right(line, floor)]
    del starts[: bisect.bisect_right(starts, floor)]
    started = len(starts)  # no start is ahead of now
    own = next((i for i, (_, member) in enumerate(line) if member == token), None)
    if own is not None:
        placed = line[own][0]
        if placed > now:
            return RateTaken(False, placed - now, len(line), now)
        if started < rate.limit:
            member = admitted_member(token, now)
            del line[own]
            bisect.insort(line, (placed, member))
            bisect.insort(starts, (now, member))
            return RateTaken(True, 0.0, len(line), now)
        # Due, but the window of real starts is still full (a call ahead started late): the call
        # keeps its place and is due again when the start that blocks it ages out (moments away).
        return RateTaken(False, starts[started - rate.limit][0] + rate.period - now, len(line), now)
    count = len(line)
    if count < rate.limit and started < rate.limit:
        member = admitted_member(token, now)
        bisect.insort(line, (now, member))
        bisect.insort(starts, (now, member))
        return RateTaken(True, 0.0, count + 1, now)
    # The first instant a place frees after every reservation (the entry ``limit`` places from the
    # end of the line ages out then), and no sooner than the real starts allow. (With a limit
    # lowered since, more than ``limit`` entries are live and the place frees once enough aged out.)
    due = now
    if count >= rate.limit:
        due = max(due, line[count - rate.limit][0] + rate.period)
    if started >= rate.limit:
        due = max(due, starts[started - rate.limit][0] + rate.period)
    if not reserve:
        return RateTaken(False, due - now, count, now)
    bisect.insort(line, (due, token))
    return RateTaken(False, due - now, count + 1, now)
