"""The beat Lua scripts (``beat/lua/*.lua``), registered once per Redis client.

Every caller in beat (the lease, the Redis backend, the runtime entries API) takes its scripts from
:func:`beat_scripts`: one registry, so each script's source is read once per process and each
client registers it once. Registering computes the SHA1 locally; Redis loads a script on the first
``EVALSHA`` that answers NOSCRIPT (redis-py's ``Script.__call__``).

Lua that several scripts share lives once, in a ``lua/_*.lua`` file of local functions (Redis runs
one script per call, with no way to load a library beside it): :func:`script_source` puts that file
before the source of each script listed in :data:`PRELUDES`.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

from ..redis_client import load_script

__all__ = ["PRELUDES", "SCRIPTS", "BeatScripts", "beat_scripts", "script_source"]

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
    "save_entries",
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


#: The shared files (``lua/<name>.lua``, no script on their own) that go before a script's source.
PRELUDES: dict[str, tuple[str, ...]] = {
    "dispatch": ("_history",),
    "history_record": ("_history",),
}


@functools.cache
def script_source(name: str) -> str:
    """The Lua source of the beat script ``name`` as Redis runs it: its preludes, then its own file."""
    return "".join(load_script(__package__, part) for part in (*PRELUDES.get(name, ()), name))


class BeatScripts:
    """The beat scripts registered on one client: ``scripts["dispatch"](keys=..., args=...)``."""

    def __init__(self, client: Any) -> None:
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}

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
