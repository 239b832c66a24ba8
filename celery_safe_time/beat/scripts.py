"""The beat Lua scripts (``beat/lua/*.lua``), registered once per Redis client.

Every caller in beat (the lease, the Redis backend, the runtime entries API) takes its scripts from
:func:`beat_scripts`: one registry, so each script's source is read once per process and each
client registers it once. Registering computes the SHA1 locally; Redis loads a script on the first
``EVALSHA`` that answers NOSCRIPT (redis-py's ``Script.__call__``).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

from ..redis_client import load_script

__all__ = ["SCRIPTS", "BeatScripts", "beat_scripts"]

#: Every beat script, by file name. The lease and the tick use the first seven; the runtime entries
#: and backfills (called by any process, not only by beats) the others.
SCRIPTS = (
    "acquire",
    "renew",
    "release",
    "dispatch",
    "dispatch_slot",
    "advance",
    "forget",
    "save_entry",
    "delete_entry",
    "run_now",
    "run_now_done",
    "prune",
    "swap_entry",
    "mark_applied",
    "claim_slots",
    "history_record",
    "history_outcome",
)


@functools.cache
def _source(name: str) -> str:
    return load_script(__package__, name)


class BeatScripts:
    """The beat scripts registered on one client: ``scripts["dispatch"](keys=..., args=...)``."""

    def __init__(self, client: Any) -> None:
        self._scripts = {name: client.register_script(_source(name)) for name in SCRIPTS}

    def __getitem__(self, name: str) -> Any:
        return self._scripts[name]


_registered: weakref.WeakKeyDictionary[Any, BeatScripts] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def beat_scripts(client: Any) -> BeatScripts:
    """The beat scripts of ``client`` (a ``redis.Redis`` or ``RedisCluster``), registered on first use."""
    with _lock:
        scripts = _registered.get(client)
        if scripts is None:
            scripts = _registered[client] = BeatScripts(client)
        return scripts
