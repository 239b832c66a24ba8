"""The sweep task that publishes due stored delays (built with the delays feature)."""

from __future__ import annotations

from celery import Celery

from .config import SafeTimeConfig


def register(app: Celery, config: SafeTimeConfig) -> None:
    """Register the sweep task and its beat entry on ``app`` (no-op until delays land)."""
