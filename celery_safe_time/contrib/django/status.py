"""django-celery-beat's entries for ``celery safe-time status``: ``SafeDatabaseScheduler`` keeps its
schedule in the ``PeriodicTask`` table, not in the Redis due set that ``SafeScheduler`` fills."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from ... import constants as C
from ...beat.admin import describe_beat

logger = logging.getLogger(__name__)


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


def describe_beat_with_django(app: Celery) -> dict[str, Any]:
    """The ``[beat]`` status section (:func:`~celery_safe_time.beat.admin.describe_beat`) with
    django-celery-beat's rows where they hold the schedule: its entries when the beat backend has none,
    and its invalid rows beside the invalid entries."""
    section = describe_beat(app)
    if "error" in section or not django_beat_in_use():
        return section
    if not section["entries_total"]:
        try:
            section["entries_total"], section["entries"] = describe_django_entries()
        except Exception as exc:  # django-celery-beat installed but its tables not migrated here
            reason = f"unreadable: {exc.__class__.__name__}: {str(exc).splitlines()[0]}"
            section["entries"] = [{"django_celery_beat": reason}]
    if isinstance(section["invalid_entries"], dict):
        from .schedulers import invalid_rows

        try:
            section["invalid_entries"].update(invalid_rows(app))
        except Exception:  # tables not migrated here: the entries above already say it
            logger.debug("django-celery-beat rows not checked", exc_info=True)
    return section
