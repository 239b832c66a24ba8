"""Beat backends: where the lease, the fired-slot guard and the schedule state live (see :mod:`.base`)."""

from __future__ import annotations

from ... import constants as C
from ...config import SafeTimeConfig
from .base import BeatBackend, BeatLease, DueRead, EntryCounts, LeaseView, SlotWrite, Snapshot

__all__ = ["BeatBackend", "BeatLease", "DueRead", "EntryCounts", "LeaseView", "SlotWrite", "Snapshot", "beat_backend"]


def beat_backend(config: SafeTimeConfig) -> BeatBackend:
    """The backend ``config`` chooses: PostgreSQL when ``safe_time_coordination_url`` names one, else Redis.

    The PostgreSQL module (and SQLAlchemy) is imported only then: importing the package loads neither.
    """
    if config.coordination == C.COORDINATION_POSTGRES:
        from .postgres import PostgresBeatBackend

        return PostgresBeatBackend(config)
    from .redis import RedisBeatBackend

    return RedisBeatBackend(config)
