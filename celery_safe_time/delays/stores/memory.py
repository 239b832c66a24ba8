"""Deprecated alias of :mod:`celery_safe_time.delays.backends.memory`."""

from __future__ import annotations

from ..backends.memory import MemoryStore

__all__ = ["MemoryStore"]
