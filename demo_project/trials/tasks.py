"""Trial-ending emails: a 14-day countdown, cancelled on upgrade, moved when a trial is extended."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from celery_safe_time import cancel, reschedule
from demo_project.tenants.models import Email, Tenant


@shared_task(bind=True)
def trial_ending_email(self, tenant_id: int) -> str:  # type: ignore[no-untyped-def]
    # Re-read current state: the tenant may have upgraded since the email was scheduled.
    tenant = Tenant.objects.get(pk=tenant_id)
    if tenant.plan != "trial":
        return "skipped: upgraded"
    Email.objects.create(tenant=tenant, kind="trial_ending", key=str(tenant_id), task_id=self.request.id)
    return "sent"


@shared_task(bind=True)
def nudge(self, tenant_id: int, due_ts: float) -> str:  # type: ignore[no-untyped-def]
    """A "we miss you" nudge; the demo sends many with long countdowns to measure firing lateness."""
    Email.objects.create(tenant_id=tenant_id, kind="nudge", key=repr(due_ts), task_id=self.request.id)
    return "nudged"


def start_trial(tenant: Tenant) -> str:
    tenant.trial_ends_at = timezone.now() + settings.TRIAL_LENGTH
    result = trial_ending_email.apply_async((tenant.id,), countdown=settings.TRIAL_LENGTH.total_seconds())
    tenant.trial_task_id = str(result.id)
    tenant.save(update_fields=["trial_ends_at", "trial_task_id"])
    return tenant.trial_task_id


def upgrade(tenant: Tenant) -> bool:
    tenant.plan = "paid"
    tenant.save(update_fields=["plan"])
    return bool(cancel(tenant.trial_task_id))


def extend_trial(tenant: Tenant, by: timedelta) -> bool:
    assert tenant.trial_ends_at is not None
    tenant.trial_ends_at = tenant.trial_ends_at + by
    tenant.save(update_fields=["trial_ends_at"])
    return bool(reschedule(tenant.trial_task_id, eta=tenant.trial_ends_at))
