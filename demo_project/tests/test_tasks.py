"""The demo's features tested the way a user tests theirs: stored delays, the test clock, locks, schedules."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from celery_safe_time.testing import SafeTimeTesting, assert_stored, next_fires, run_due, stored_delays
from demo_project.billing.tasks import schedule_morning_reminder, send_invoice, send_reminder
from demo_project.celery_app import app
from demo_project.inventory.tasks import sync_inventory
from demo_project.tenants.models import Email, Tenant
from demo_project.trials.tasks import extend_trial, start_trial, trial_ending_email, upgrade

pytestmark = pytest.mark.django_db
UTC = timezone.utc


def _tenant(name: str = "acme", tz: str = "UTC") -> Tenant:
    return Tenant.objects.create(name=name, timezone=tz)


def test_trial_ending_email_is_stored_for_14_days_and_sent_once(safe_time: SafeTimeTesting) -> None:
    tenant = _tenant()
    task_id = start_trial(tenant)
    stored = assert_stored(trial_ending_email, args=(tenant.id,), due_within=timedelta(days=14, minutes=1))
    assert stored.id == task_id
    assert stored.due_at > safe_time.now() + timedelta(days=13, hours=23)

    assert run_due(advance=timedelta(days=13)) == []
    assert not Email.objects.filter(kind="trial_ending").exists()
    results = run_due(advance=timedelta(days=1, minutes=1))
    assert [(r.task, r.result) for r in results] == [(trial_ending_email.name, "sent")]
    assert Email.objects.filter(kind="trial_ending", tenant=tenant).count() == 1


def test_upgrading_cancels_the_trial_email(safe_time: SafeTimeTesting) -> None:
    tenant = _tenant()
    start_trial(tenant)
    assert upgrade(tenant)
    assert stored_delays(trial_ending_email) == []
    assert run_due(advance=timedelta(days=15)) == []
    assert not Email.objects.exists()


def test_extending_the_trial_moves_the_email(safe_time: SafeTimeTesting) -> None:
    tenant = _tenant()
    start_trial(tenant)
    assert extend_trial(tenant, timedelta(days=7))
    safe_time.assert_stored(trial_ending_email, due_after=timedelta(days=20, hours=23))
    run_due(advance=timedelta(days=15))
    assert not Email.objects.exists()
    run_due(advance=timedelta(days=6, hours=1))
    assert Email.objects.filter(kind="trial_ending").count() == 1


def test_morning_reminder_is_due_at_nine_local_and_sent_once_per_day(safe_time: SafeTimeTesting) -> None:
    tenant = _tenant(tz="Europe/Berlin")
    schedule_morning_reminder(tenant)
    schedule_morning_reminder(tenant)  # asked twice: idempotent per tenant and day
    reminders = stored_delays(send_reminder)
    assert len(reminders) == 2
    local = reminders[0].due_at.astimezone(ZoneInfo("Europe/Berlin"))
    assert (local.hour, local.minute) == (9, 0)
    run_due(advance=timedelta(days=1, hours=1))
    assert Email.objects.filter(kind="reminder").count() == 1
    safe_time.assert_idempotent_done(f"reminder:{tenant.id}:{local.date().isoformat()}")


def test_an_invoice_is_sent_once_per_tenant_and_period(safe_time: SafeTimeTesting) -> None:
    tenant = _tenant()
    send_invoice.apply_async((tenant.id, "2026-11"), countdown=3600)
    send_invoice.apply_async((tenant.id, "2026-11"), countdown=7200)
    results = safe_time.run_due(advance=timedelta(hours=3))
    assert [r.result for r in results] == [f"invoice {tenant.id} 2026-11", None]
    assert Email.objects.filter(kind="invoice").count() == 1


def test_monthly_invoices_fire_at_two_utc_on_the_first() -> None:
    entry = app.conf.beat_schedule["monthly-invoices"]
    fires = next_fires(entry, n=3, after=datetime(2026, 1, 15, tzinfo=UTC), app=app)
    assert fires == [datetime(2026, m, 1, 2, 0, tzinfo=UTC) for m in (2, 3, 4)]


def test_an_inventory_sync_whose_account_is_busy_is_skipped(safe_time: SafeTimeTesting, settings: object) -> None:
    from celery_safe_time.locks.backends import Owner

    settings.SYNC_SECONDS = 0  # type: ignore[attr-defined]
    safe_time.locks.acquire("sync:1", "someone-else", 60, Owner("other-task", "other", "host", 1))
    sync_inventory.apply_async((1,), countdown=10)
    sync_inventory.apply_async((2,), countdown=10)
    results = safe_time.run_due(advance=20)
    assert sorted(str(r.result) for r in results) == ["None", "synced 2"]
    safe_time.assert_lock_held("sync:1")
    safe_time.assert_lock_free("sync:2")
