"""What kind of concurrency this process runs tasks under."""

from __future__ import annotations

import sys


def green_threads() -> bool:
    """True under gevent/eventlet monkey-patching, where many tasks share one OS thread."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"))
