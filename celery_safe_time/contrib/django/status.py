"""django-celery-beat's entries for ``celery safe-time status``: ``SafeDatabaseScheduler`` keeps its
schedule in the ``PeriodicTask`` table, not in the Redis due set that ``SafeScheduler`` fills."""

from __future__ import annotations

from typing import Any

from ... import constants as C


def django_beat_in_use() -> bool:
    """True when Django is set up with django-celery-beat installed (its tables hold the schedule)."""
    try:
        from django.apps import apps
    except ImportError:
        return False
    return bool(apps.ready and apps.is_installed("django_celery_beat"))


def describe_django_entries() -> tuple[int, list[dict[str, Any]]]:
    """(number of enabled ``PeriodicTask`` rows, the first ones by name with their last run and count)."""
    from django_celery_beat.models import PeriodicTask

    enabled = PeriodicTask.objects.filter(enabled=True)
    rows = enabled.order_by("name").values("name", "last_run_at", "total_run_count")[: C.BEAT_STATUS_ENTRIES]
    entries = [
        {
            "entry": row["name"],
            "last_slot": row["last_run_at"].isoformat() if row["last_run_at"] else None,
            "runs": row["total_run_count"],
            "source": "django-celery-beat",
        }
        for row in rows
    ]
    return enabled.count(), entries
