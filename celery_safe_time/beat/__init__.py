"""Single-leader beat: ``SafeScheduler`` fires while it holds the Redis lease, each slot at most once.

:mod:`.base` is what both schedulers share (the contrib Django one included), :mod:`.lease` the
lease and dispatch scripts (``lua/``), :mod:`.leader` the thread that keeps the lease, :mod:`.slots`
the slot grids and misfire rules, :mod:`.entries` the runtime entries (``save_entry``...),
:mod:`.redbeat` the import from celery-redbeat, :mod:`.admin` the status view.
"""

from __future__ import annotations

from .scheduler import SafeScheduler

__all__ = ["SafeScheduler"]
