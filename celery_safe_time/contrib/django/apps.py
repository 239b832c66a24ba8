"""Django app config for celery-safe-time."""

from __future__ import annotations

from django.apps import AppConfig, apps


class SafeTimeConfig(AppConfig):
    name = "celery_safe_time.contrib.django"
    label = "celery_safe_time"
    verbose_name = "Celery safe time"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # django-celery-beat's rows are SafeDatabaseScheduler's entries: their changes go into the
        # entries' change audit like a runtime entry's (see .audit)
        if apps.is_installed("django_celery_beat"):
            from . import audit

            audit.connect()
