"""``celery -A proj safe-time ...``: the operator's command (a ``celery.commands`` plugin).

Sections: ``check`` and ``status`` (every capability), then ``beat ...``, ``delays ...``, ``sweep`` and
``locks ...``, one module each; importing this package registers every command on :data:`safe_time`.
Each command imports its capability lazily, so ``celery --help`` stays fast and Django-free.
"""

from __future__ import annotations

from ..checks import run_checks
from .base import SafeTimeGroup, safe_time
from .beat_commands import (
    beat_add,
    beat_backfill,
    beat_group,
    beat_import,
    beat_import_redbeat,
    beat_list,
    beat_pause,
    beat_remove,
    beat_resume,
    beat_run_now,
    beat_show,
)
from .delay_commands import (
    delays,
    delays_cancel,
    delays_list,
    delays_purge,
    delays_rerun,
    delays_reschedule,
    delays_show,
    sweep,
)
from .lock_commands import locks_group, locks_list, locks_release
from .status_commands import check, probe_beat, probe_store, probe_sweep, run_probes, status

__all__ = [
    "SafeTimeGroup",
    "beat_add",
    "beat_backfill",
    "beat_group",
    "beat_import",
    "beat_import_redbeat",
    "beat_list",
    "beat_pause",
    "beat_remove",
    "beat_resume",
    "beat_run_now",
    "beat_show",
    "check",
    "delays",
    "delays_cancel",
    "delays_list",
    "delays_purge",
    "delays_rerun",
    "delays_reschedule",
    "delays_show",
    "locks_group",
    "locks_list",
    "locks_release",
    "probe_beat",
    "probe_store",
    "probe_sweep",
    "run_checks",
    "run_probes",
    "safe_time",
    "status",
    "sweep",
]
