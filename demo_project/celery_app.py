"""The demo's Celery app, configured from Django settings like any Django project."""

from __future__ import annotations

import os
from datetime import timedelta

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
django.setup()

from django.conf import settings  # noqa: E402

import celery_safe_time  # noqa: E402

# Every task of the project goes through SafeTask: long countdowns land in the store.
app = Celery("demo_project", task_cls="celery_safe_time:SafeTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["demo_project.billing", "demo_project.trials", "demo_project.inventory"])


def _schedule() -> dict[str, dict[str, object]]:
    if settings.INVOICE_EVERY:
        invoices: object = timedelta(seconds=float(settings.INVOICE_EVERY))
    else:
        # 02:00 UTC on the 1st: a DST-correct crontab (tz= works for any IANA zone).
        invoices = celery_safe_time.crontab(minute=0, hour=2, day_of_month=1, tz="UTC")
    schedule: dict[str, dict[str, object]] = {
        "monthly-invoices": {"task": "demo_project.billing.tasks.run_invoices", "schedule": invoices},
    }
    for account_id in (1, 2, 3):
        schedule[f"inventory-sync-{account_id}"] = {
            "task": "demo_project.inventory.tasks.sync_inventory",
            "schedule": timedelta(seconds=settings.SYNC_EVERY),
            "args": (account_id,),
        }
    return schedule


app.conf.beat_schedule = _schedule()
celery_safe_time.install(app)
