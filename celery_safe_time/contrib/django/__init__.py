"""Django add-on: the stored-delay model, migrations and admin, and ``SafeDatabaseScheduler``.

Add ``"celery_safe_time.contrib.django"`` to ``INSTALLED_APPS`` (with ``django_celery_beat``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SafeDatabaseScheduler"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the scheduler needs configured Django settings.
    if name == "SafeDatabaseScheduler":
        from .schedulers import SafeDatabaseScheduler

        return SafeDatabaseScheduler
    raise AttributeError(name)
