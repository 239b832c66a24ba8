"""Single-leader beat: ``SafeScheduler`` fires while it holds the lease, each slot at most once.

The lease, the fired-slot guard and the schedule state live in a beat backend (:mod:`.backends`:
Redis by default, PostgreSQL with ``safe_time_coordination_url``, memory for tests). The modules
import in one order, each only from those before it:

- :mod:`.state` the state JSON and the slot and marker ids every backend writes;
- :mod:`.backends` the backends (:mod:`.backends.redis` holds the Redis lease and its Lua scripts);
- :mod:`.slots` the slot grids, entry plans and misfire rules;
- :mod:`.leader` the thread that keeps the lease, :mod:`.base` what both schedulers share (the
  contrib Django one included);
- :mod:`.entries` the runtime entries (``save_entry``...), :mod:`.scheduler` ``SafeScheduler``;
- :mod:`.history` the run history and change audit per entry (the worker's outcome hooks too);
- :mod:`.backfill` publishes the unfired slots of a past range, guarded like the leader's;
- :mod:`.redbeat` the import from celery-redbeat, :mod:`.admin` the status view.
"""

from __future__ import annotations

from .scheduler import SafeScheduler

__all__ = ["SafeScheduler"]
