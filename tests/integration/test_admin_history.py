"""The admin's beat entry page: the entry's last runs (with the outcome a worker reported) and its
changes, linked from the overview; read-only, through Django's test client."""

from __future__ import annotations

import types
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from django.test import Client

from celery_safe_time import constants as C
from celery_safe_time import save_entry
from celery_safe_time.beat import history
from celery_safe_time.beat.backends import SlotWrite, beat_backend
from celery_safe_time.beat.entries import pause
from celery_safe_time.beat.state import dump_state
from celery_safe_time.config import get_config

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

OVERVIEW = "/admin/celery_safe_time/delayedtask/overview/"


def _noop() -> None:
    return None


@pytest.fixture
def admin_app(make_app: Callable[..., Celery], settings: Any) -> Celery:
    app = make_app("admin-history", safe_time_store_url="django", safe_time_key_prefix="admh:")
    app.task(name="tests.report", shared=False)(_noop)
    settings.SAFE_TIME_CELERY_APP = app
    return app


def test_the_entry_page_shows_runs_with_outcomes_and_changes(admin_client: Client, admin_app: Celery) -> None:
    save_entry("tenant 7/report", "tests.report", 60, app=admin_app, changed_by="ann@ops")
    pause("tenant 7/report", note="migration", app=admin_app, changed_by="bob@ops")
    backend = beat_backend(get_config(admin_app))
    lease = backend.make_lease(info={"host": "beat-host-9", "pid": 1})
    now = backend.clock.time()
    epoch = lease.acquire(now)
    assert epoch is not None
    slots = [float(int(now)) - 120, float(int(now)) - 60]
    writes = [SlotWrite("tenant 7/report", dump_state(s, s + 60, "sig"), s + 60, s) for s in slots]
    writes, ids = history.stamp_writes(writes, epoch, now, get_config(admin_app).beat_history_size)
    assert lease.write_slots(epoch, writes) == [1, 1]
    lease.release()
    request = types.SimpleNamespace(
        headers={
            C.HEADER_ENTRY: "tenant 7/report",
            C.HEADER_SLOT: datetime.fromtimestamp(slots[1], timezone.utc).isoformat(),
        },
        hostname="worker-7",
    )
    history.report_outcome(admin_app, request, "FAILURE", ids[("tenant 7/report", slots[1])])

    overview = admin_client.get(OVERVIEW).content.decode()
    assert 'href="/admin/celery_safe_time/delayedtask/overview/entry/tenant%207/report/"' in overview
    page = admin_client.get(OVERVIEW + "entry/tenant%207/report/")
    assert page.status_code == 200
    body = page.content.decode()
    assert body.count(ids[("tenant 7/report", slots[0])]) == 1
    assert ">published<" in body  # no outcome reported for the first run
    assert "failed" in body
    assert "worker-7" in body
    assert "bob@ops" in body
    assert "ann@ops" in body
    assert "migration" in body
    assert '<td class="action">pause</td>' in body
    assert '<td class="action">create</td>' in body
    empty = admin_client.get(OVERVIEW + "entry/nothing-here/").content.decode()
    assert "No runs recorded." in empty
    assert "No changes recorded." in empty


def _dcb_row(name: str, args: str) -> Any:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every, _ = IntervalSchedule.objects.get_or_create(every=60, period=IntervalSchedule.SECONDS)
    return PeriodicTask.objects.create(name=name, task="tests.report", interval=every, args=args)


def test_beat_entry_pages_need_django_celery_beat_view_permission(client: Client, admin_app: Celery) -> None:
    from django.contrib.auth.models import Permission, User

    _dcb_row("payroll", '["acct-secret-991"]')
    staff = User.objects.create_user("staff-dcb", password="pw", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_delayedtask"))
    client.force_login(staff)
    overview = client.get(OVERVIEW)
    assert overview.status_code == 200
    assert "payroll" not in overview.content.decode()
    assert "Can view periodic task" in overview.content.decode()
    assert client.get(OVERVIEW + "entry/payroll/").status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_periodictask"))
    staff = User.objects.get(pk=staff.pk)  # permissions are cached per user object
    client.force_login(staff)
    assert 'href="/admin/celery_safe_time/delayedtask/overview/entry/payroll/"' in client.get(OVERVIEW).content.decode()
    assert client.get(OVERVIEW + "entry/payroll/").status_code == 200


def test_the_overview_lists_any_stored_name(admin_client: Client, admin_app: Celery) -> None:
    _dcb_row("", "[]")
    _dcb_row("two\nlines", "[]")
    overview = admin_client.get(OVERVIEW)
    assert overview.status_code == 200
    body = overview.content.decode()
    assert "(no name)" in body
    assert 'href="/admin/celery_safe_time/delayedtask/overview/entry/two%0Alines/"' in body
    assert admin_client.get(OVERVIEW + "entry/two%0Alines/").status_code == 200
