"""Beat backends: where the lease, the fired-slot guard and the schedule state live (see :mod:`.base`)."""

from __future__ import annotations

from ...config import SafeTimeConfig
from ...coordination import uses_postgres
from .base import BeatBackend, BeatLease, DueRead, LeaseView, SlotWrite, Snapshot

__all__ = ["BeatBackend", "BeatLease", "DueRead", "LeaseView", "SlotWrite", "Snapshot", "beat_backend"]


def beat_backend(config: SafeTimeConfig) -> BeatBackend:
    """The backend ``config`` chooses: PostgreSQL when ``safe_time_coordination_url`` names one, else Redis."""
    if uses_postgres(config):
        from .postgres import PostgresBeatBackend

        return PostgresBeatBackend(config)
    from .redis import RedisBeatBackend

    return RedisBeatBackend(config)
