"""Invoices once per tenant per period, and 09:00-local reminders in each tenant's timezone."""

from __future__ import annotations

from datetime import datetime, time, timezone

from celery import shared_task

from celery_safe_time import idempotent, next_local
from demo_project.tenants.models import Email, Tenant

from .models import InvoiceRun


@shared_task(bind=True)
def run_invoices(self) -> int:  # type: ignore[no-untyped-def]
    """Fan out one invoice per tenant for the period of this slot."""
    slot = (self.request.headers or {}).get("safe_time_slot")
    period = str(slot) if slot else datetime.now(timezone.utc).strftime("%Y-%m")
    InvoiceRun.objects.create(slot=period, task_id=self.request.id or "", hostname=self.request.hostname or "")
    tenants = list(Tenant.objects.values_list("id", flat=True))
    for tenant_id in tenants:
        send_invoice.delay(tenant_id, period)
    return len(tenants)


@shared_task(bind=True)
@idempotent("invoice:{tenant_id}:{period}", window=40 * 86400)
def send_invoice(self, tenant_id: int, period: str) -> str:  # type: ignore[no-untyped-def]
    Email.objects.create(tenant_id=tenant_id, kind="invoice", key=f"{tenant_id}:{period}", task_id=self.request.id)
    return f"invoice {tenant_id} {period}"


@shared_task(bind=True)
@idempotent("reminder:{tenant_id}:{day}", window=2 * 86400)
def send_reminder(self, tenant_id: int, day: str) -> str:  # type: ignore[no-untyped-def]
    Email.objects.create(tenant_id=tenant_id, kind="reminder", key=f"{tenant_id}:{day}", task_id=self.request.id)
    return f"reminder {tenant_id} {day}"


@shared_task(bind=True)
def send_usage_report(self, tenant_id: int) -> str:  # type: ignore[no-untyped-def]
    """A tenant's periodic report: its schedule is a runtime entry (``save_entry``), added while beat runs."""
    slot = str((self.request.headers or {}).get("safe_time_slot") or "")
    Email.objects.create(tenant_id=tenant_id, kind="usage_report", key=f"{tenant_id}:{slot}", task_id=self.request.id)
    return f"usage report {tenant_id} {slot}"


def schedule_morning_reminder(tenant: Tenant, after: datetime | None = None) -> str:
    """Queue tomorrow's (or today's) 09:00 reminder in the tenant's own timezone.

    The eta is an aware UTC instant computed with the DST rules; it is hours away, so
    SafeTask stores it instead of parking it in a worker's memory.
    """
    eta = next_local(time(9, 0), tz=tenant.timezone, after=after)
    result = send_reminder.apply_async((tenant.id, eta.date().isoformat()), eta=eta)
    return str(result.id)
