"""Schedule policies per entry: jitter and the catch-up window. Pure functions, time passed in.

- **Jitter** (``options={"safe_time_jitter": 30}``, seconds or a ``timedelta``): each slot is
  published at an offset within ``[0, jitter)`` of its slot. The offset is a hash of the entry's
  name and the slot, so every beat computes the same one (a failover publishes a slot at the
  offset the old leader would have) and the slot keeps its identity: the dispatch guard and the
  ``safe_time_slot`` header name the slot, never the jittered instant.
- **Catch-up window** (``options={"safe_time_catchup_window": 3600}``): a slot published more than
  this late is skipped, whatever the misfire policy.
- **Overlap** (``options={"safe_time_overlap": "skip"}``, ``overlap=`` in ``save_entry`` and
  ``beat_schedule``; ``options={"overlap": ...}`` is an alias): what a slot does while a run of the
  entry is queued or running (:mod:`.overlap`). ``safe_time_overlap_ttl`` (``overlap_ttl=``) is the
  lease of a run, in seconds (default ``safe_time_lock_ttl``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from celery.utils.dispatch import Signal

from .. import constants as C
from ..exceptions import ScheduleError
from .state import slot_id

__all__ = [
    "OPTION_CATCHUP_WINDOW",
    "OPTION_JITTER",
    "OPTION_OVERLAP",
    "OPTION_OVERLAP_TTL",
    "Policies",
    "beat_slot_dropped",
    "beat_slots_past_catchup",
    "config_spec",
    "jitter_offset",
    "overlap_option",
    "policies_of",
    "policy_options",
    "seconds_option",
    "unjitter",
]

#: Per-entry jitter in seconds (``options``; ``jitter=`` in ``save_entry`` and ``beat_schedule``).
OPTION_JITTER = "safe_time_jitter"
#: Per-entry catch-up window in seconds (``options``; ``catchup_window=`` in ``save_entry`` and ``beat_schedule``).
OPTION_CATCHUP_WINDOW = "safe_time_catchup_window"
#: Per-entry overlap policy (``options``; ``overlap=`` in ``save_entry`` and ``beat_schedule``).
OPTION_OVERLAP = "safe_time_overlap"
#: Per-entry lease of a run under an overlap policy, in seconds (``overlap_ttl=``).
OPTION_OVERLAP_TTL = "safe_time_overlap_ttl"
#: The short spelling of ``safe_time_overlap`` in ``options`` (moved to the long one, never sent).
_OVERLAP_ALIAS = "overlap"

#: Slots were skipped because they were later than their entry's catch-up window. kwargs: entry, count.
beat_slots_past_catchup = Signal(name="beat_slots_past_catchup", providing_args={"entry", "count"})

#: A slot was not published because of its entry's overlap policy (a run of it was queued or running).
#: kwargs: entry, slot (a UTC datetime), policy, reason (``"running"`` or ``"queued"``).
beat_slot_dropped = Signal(name="beat_slot_dropped", providing_args={"entry", "slot", "policy", "reason"})

#: The resolution of an offset (the slot ids are in milliseconds too).
_RESOLUTION = 1000


def seconds_option(value: Any, option: str, name: str, *, zero_ok: bool) -> float:
    """``value`` (a number of seconds or a ``timedelta``) as seconds; :class:`ScheduleError` naming
    the entry and the option when it is not a finite number at least 0 (above 0 unless ``zero_ok``)."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ScheduleError(f"entry {name!r}: {option} must be a number of seconds or a timedelta, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        bound = "at least 0" if zero_ok else "above 0"
        raise ScheduleError(f"entry {name!r}: {option} must be {bound} seconds, got {value!r}")
    return seconds


@dataclasses.dataclass(frozen=True)
class Policies:
    """An entry's jitter and catch-up window, in seconds (0 and None: none)."""

    jitter: float = 0.0
    catchup_window: float | None = None


def policies_of(options: Mapping[str, Any] | None, name: str) -> Policies:
    """The policies an entry's options set (validated: :class:`ScheduleError` names the entry and option)."""
    options = options or {}
    jitter = options.get(OPTION_JITTER)
    window = options.get(OPTION_CATCHUP_WINDOW)
    return Policies(
        jitter=0.0 if jitter is None else seconds_option(jitter, OPTION_JITTER, name, zero_ok=True),
        catchup_window=None if window is None else seconds_option(window, OPTION_CATCHUP_WINDOW, name, zero_ok=False),
    )


def overlap_option(value: Any, name: str) -> str:
    """``value`` as an overlap policy; :class:`ScheduleError` naming the entry and the allowed values."""
    if value not in C.OVERLAP_POLICIES:
        raise ScheduleError(
            f"entry {name!r}: {OPTION_OVERLAP} must be one of {', '.join(C.OVERLAP_POLICIES)}, got {value!r}"
        )
    return str(value)


#: The keyword of each policy (``save_entry(jitter=...)``, a ``beat_schedule`` entry's key) and its option.
KEYWORDS = {
    "jitter": OPTION_JITTER,
    "catchup_window": OPTION_CATCHUP_WINDOW,
    "overlap": OPTION_OVERLAP,
    "overlap_ttl": OPTION_OVERLAP_TTL,
}


def policy_options(name: str, options: Mapping[str, Any] | None, **keywords: Any) -> dict[str, Any]:
    """``options`` with the policies given as keywords (``jitter=``, ``catchup_window=``; None: not
    given) set, every policy as seconds (a ``timedelta`` is converted, so the options are JSON).
    :class:`ScheduleError` names the entry and the option when a value is not valid, or when a
    keyword and its option are both given."""
    out = dict(options or {})
    if _OVERLAP_ALIAS in out:
        if OPTION_OVERLAP in out:
            raise ScheduleError(
                f"entry {name!r}: overlap is given twice (options.overlap and options.{OPTION_OVERLAP})"
            )
        out[OPTION_OVERLAP] = out.pop(_OVERLAP_ALIAS)
    for keyword, value in keywords.items():
        option = KEYWORDS.get(keyword)
        if option is None:
            raise ScheduleError(f"entry {name!r}: unknown schedule policy {keyword!r} ({', '.join(KEYWORDS)})")
        if value is None:
            continue
        if option in out:
            raise ScheduleError(f"entry {name!r}: {keyword} is given twice (as {keyword}= and in options.{option})")
        out[option] = value
    for option in KEYWORDS.values():
        if option == OPTION_OVERLAP and option in out:
            out[option] = overlap_option(out[option], name)
        elif option in out:  # a jitter may be 0, the other durations not
            out[option] = seconds_option(out[option], option, name, zero_ok=option == OPTION_JITTER)
    return out


def config_spec(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A ``beat_schedule`` entry with its ``jitter`` / ``catchup_window`` / ``overlap`` keys moved into
    its options (validated, as ``save_entry`` does)."""
    spec = dict(spec)
    keywords = {keyword: spec.pop(keyword) for keyword in KEYWORDS if keyword in spec}
    options = spec.get("options") or {}
    if keywords or _OVERLAP_ALIAS in options or OPTION_OVERLAP in options or OPTION_OVERLAP_TTL in options:
        spec["options"] = policy_options(name, spec.get("options"), **keywords)
    return spec


def jitter_offset(name: str, slot: float, jitter: float) -> float:
    """The offset in ``[0, jitter)`` at which ``name`` publishes ``slot`` (whole milliseconds).

    A hash of the name and the slot's id (SHA-256, not Python's ``hash``, which differs between
    processes): the same in every beat, spread evenly over the window across entries and slots.
    """
    if jitter <= 0:
        return 0.0
    digest = hashlib.sha256(f"{name}\0{slot_id(slot)}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2.0**64
    return math.floor(fraction * jitter * _RESOLUTION) / _RESOLUTION


def offset_function(name: str, jitter: float) -> Callable[[float], float] | None:
    """``slot -> offset`` for ``name`` (None without jitter)."""
    if jitter <= 0:
        return None
    return lambda slot: jitter_offset(name, slot, jitter)


def unjitter(name: str, due: float, jitter: float, candidates: Callable[[float, float], list[float]]) -> float:
    """The slot whose jittered instant is ``due``: used only when an entry's state was lost and its
    due time survived (the state holds the slot itself). ``candidates(low, high)`` lists the grid's
    slots in ``(low, high]``; when none matches, ``due`` less its own offset (an interval's grid then
    moves by less than the jitter, and no slot is published twice: the slot it stands for never fired).
    """
    if jitter <= 0 or not math.isfinite(due):
        return due
    for slot in candidates(due - jitter, due):
        if abs(slot + jitter_offset(name, slot, jitter) - due) < 0.5 / _RESOLUTION:
            return slot
    return due - jitter_offset(name, due, jitter)
