"""An entry's schedule state and the identifiers every beat backend writes, whatever stores them.

The state of an entry is a JSON object (``{"last": ..., "next": ..., "sig": ...}``, :func:`dump_state`,
:func:`load_state`); a fired slot is named by :func:`slot_id` and its marker holds :func:`marker_value`;
a lease holder describes itself with :func:`identity`. Pure functions: no backend, no client.
"""

from __future__ import annotations

import json
import math
import os
import socket
import uuid
from datetime import datetime
from typing import Any

from ..clock import UTC

__all__ = ["dump_state", "identity", "load_state", "marker_value", "slot_id", "state_next", "with_definitions"]


def identity() -> dict[str, Any]:
    """Who holds a lease: this host and process."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def marker_value(epoch: int) -> str:
    """A fired marker's value, new per dispatch (per write of a batch): ``"<epoch>:<nonce>"``.

    redis-py may send a command again after a timeout whatever ``retry_on_timeout`` says; when the
    first attempt ran but its reply was lost, the second finds the marker set. With the call's own
    value there it still answers "publish" (the slot was never published), where a bare epoch would
    answer "already fired" and the slot would be missed.
    """
    return f"{epoch}:{uuid.uuid4().hex[:12]}"


def slot_id(slot: float) -> str:
    """A slot's marker id: the UTC instant in whole milliseconds (stable across processes)."""
    return str(round(slot * 1000))


def epoch(value: Any) -> float | None:
    """A stored epoch time in seconds; None when absent or not a number."""
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def instant(value: Any) -> datetime | None:
    """A stored epoch time as a UTC datetime; None when absent, never (infinite) or unreadable, so one
    broken state shows as unknown instead of failing a whole listing."""
    seconds = epoch(value)
    try:
        return None if seconds is None else datetime.fromtimestamp(seconds, UTC)
    except (ValueError, OverflowError):
        return None


def load_state(raw: Any) -> dict[str, Any]:
    """A stored JSON object: one entry's state (``last``, ``next``, ``sig``), the leader info, a run
    or audit record; {} when absent or broken."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def dump_state(last: float | None, next_fire: float, sig: str) -> str:
    """One entry's state JSON. A schedule with no slot left (a fired one-off) has ``"next": null``:
    ``json.dumps`` would write ``Infinity``, which is not JSON and other languages' parsers reject."""
    return json.dumps({"last": last, "next": next_fire if math.isfinite(next_fire) else None, "sig": sig})


def state_next(state: dict[str, Any]) -> float:
    """The next slot of a state written by :func:`dump_state` (``NEVER``, infinity, for null)."""
    value = state.get("next")
    return math.inf if value is None else float(value)


def with_definitions(meta: str, old: str | None, new: str | None, version: int | None) -> str:
    """An audit record: ``meta`` (the text of a JSON object: when, who, action) with the old and new
    definitions (JSON texts) and the version added. Text concatenation, as the Redis scripts do it,
    so every backend stores the same bytes."""
    return (
        meta[:-1] + ',"old":' + (old or "null") + ',"new":' + (new or "null") + ',"version":'
        + ("null" if version is None else str(int(version))) + "}"
    )  # fmt: skip
