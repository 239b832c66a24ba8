"""Django app config for celery-safe-time."""

from __future__ import annotations

from django.apps import AppConfig


class SafeTimeConfig(AppConfig):
    name = "celery_safe_time.contrib.django"
    label = "celery_safe_time"
    verbose_name = "Celery safe time"
    default_auto_field = "django.db.models.BigAutoField"
