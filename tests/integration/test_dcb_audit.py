"""django-celery-beat rows in the change audit: ORM saves and deletes, django-celery-beat's own admin
(change form, delete page, the enable/disable/toggle actions) through Django's test client, on the
test Redis; a beat backend that is down never fails the save."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client

from celery_safe_time.beat.history import AuditRecord, entry_audit
from tests.helpers.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

TASKS = "/admin/django_celery_beat/periodictask/"


@pytest.fixture
def dcb_app(make_app: Callable[..., Celery], settings: Any) -> Celery:
    app = make_app("dcb-audit", safe_time_store_url="django", safe_time_key_prefix="dcba:")
    settings.SAFE_TIME_CELERY_APP = app
    return app


@pytest.fixture
def alice() -> Client:
    user = User.objects.create_superuser("alice", "alice@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def _every(minutes: int) -> Any:
    from django_celery_beat.models import IntervalSchedule

    return IntervalSchedule.objects.get_or_create(every=minutes, period=IntervalSchedule.MINUTES)[0]


def _changes(name: str, app: Celery) -> list[AuditRecord]:
    return list(reversed(entry_audit(name, app=app)))  # oldest first


def test_orm_create_update_enable_disable_rename_delete_are_audited(dcb_app: Celery) -> None:
    from django_celery_beat.models import CrontabSchedule, PeriodicTask

    row = PeriodicTask.objects.create(name="tenant-1", task="reports.send", interval=_every(5), args="[1]")
    row.kwargs = '{"full": true}'
    row.interval = None
    row.crontab = CrontabSchedule.objects.create(minute="0", hour="9", timezone="Europe/Berlin")
    row.headers = '{"safe_time_jitter": 30}'
    row.save()
    row.enabled = False
    row.save()
    row.enabled = True
    row.save()
    # the scheduler's bookkeeping after a run is no change
    row.total_run_count += 1
    row.save()

    changes = _changes("tenant-1", dcb_app)
    assert [c.action for c in changes] == ["create", "update", "disable", "enable"]
    create, update, disable, enable = changes
    assert create.old is None
    assert create.new is not None
    assert create.new["name"] == "tenant-1"
    assert create.new["task"] == "reports.send"
    assert create.new["schedule"] == {"type": "interval", "every": 300.0}
    assert create.new["args"] == [1]
    assert create.new["enabled"] is True
    assert update.old == create.new
    assert update.new is not None
    assert update.new["kwargs"] == {"full": True}
    assert update.new["schedule"] == {
        "type": "crontab",
        "minute": "0",
        "hour": "9",
        "day_of_week": "*",
        "day_of_month": "*",
        "month_of_year": "*",
        "tz": "Europe/Berlin",
    }
    assert update.new["options"]["headers"] == {"safe_time_jitter": 30}
    assert disable.new is not None
    assert disable.new["enabled"] is False
    assert enable.new is not None
    assert enable.new["enabled"] is True
    # no admin request: the package's default, user@host pid N
    assert all(" pid " in c.changed_by and "django admin" not in c.changed_by for c in changes)

    row.name = "tenant-1b"
    row.save()
    renamed = _changes("tenant-1b", dcb_app)
    assert [c.action for c in renamed] == ["update"]
    assert renamed[0].old is not None
    assert renamed[0].old["name"] == "tenant-1"
    assert renamed[0].new is not None
    assert renamed[0].new["name"] == "tenant-1b"
    assert len(_changes("tenant-1", dcb_app)) == 4  # the old name's audit is kept as it was

    PeriodicTask.objects.filter(name="tenant-1b").delete()
    deleted = _changes("tenant-1b", dcb_app)[-1]
    assert deleted.action == "delete"
    assert deleted.new is None
    assert deleted.old is not None
    assert deleted.old["schedule"]["type"] == "crontab"


def test_a_rolled_back_change_leaves_no_record(dcb_app: Celery) -> None:
    from django_celery_beat.models import PeriodicTask

    def create_then_fail() -> None:
        with transaction.atomic():
            PeriodicTask.objects.create(name="never", task="reports.send", interval=_every(5))
            raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        create_then_fail()
    assert entry_audit("never", app=dcb_app) == []


def test_the_admin_change_form_records_the_logged_in_user(dcb_app: Celery, alice: Client) -> None:
    from django_celery_beat.models import PeriodicTask

    every = _every(10)
    form = {
        "name": "tenant-2",
        "regtask": "",
        "task": "reports.send",
        "enabled": "on",
        "description": "",
        "interval": str(every.pk),
        "args": "[]",
        "kwargs": "{}",
        "headers": "{}",
        "expire_seconds": "",
        "queue": "",
        "exchange": "",
        "routing_key": "",
        "priority": "",
    }
    added = alice.post(TASKS + "add/", form)
    assert added.status_code == 302, added.content.decode()[:2000]
    row = PeriodicTask.objects.get(name="tenant-2")
    changed = alice.post(TASKS + f"{row.pk}/change/", {**form, "args": "[7]", "queue": "reports"})
    assert changed.status_code == 302, changed.content.decode()[:2000]
    deleted = alice.post(TASKS + f"{row.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert not PeriodicTask.objects.filter(name="tenant-2").exists()

    changes = _changes("tenant-2", dcb_app)
    assert [c.action for c in changes] == ["create", "update", "delete"]
    assert {c.changed_by for c in changes} == {"alice (django admin)"}
    update = changes[1]
    assert update.old is not None
    assert update.old["args"] == []
    assert update.new is not None
    assert update.new["args"] == [7]
    assert update.new["options"]["queue"] == "reports"

    # the entry page shows them
    page = alice.get("/admin/celery_safe_time/delayedtask/overview/entry/tenant-2/").content.decode()
    assert "alice (django admin)" in page
    assert '<td class="action">delete</td>' in page


def test_the_admin_enable_disable_and_toggle_actions_are_audited(dcb_app: Celery, alice: Client) -> None:
    from django_celery_beat.models import PeriodicTask

    every = _every(15)
    rows = [PeriodicTask.objects.create(name=f"bulk-{i}", task="reports.send", interval=every) for i in range(2)]
    PeriodicTask.objects.filter(name="bulk-1").update(enabled=False)  # a bulk update outside the admin: not audited
    pks = [str(r.pk) for r in rows]

    def act(action: str) -> None:
        response = alice.post(TASKS, {"action": action, "_selected_action": pks, "index": "0"})
        assert response.status_code == 302, response.content.decode()[:2000]

    act("disable_tasks")  # bulk-0 disabled; bulk-1 was already: no record
    act("enable_tasks")  # both enabled
    act("toggle_tasks")  # both disabled
    first = _changes("bulk-0", dcb_app)
    second = _changes("bulk-1", dcb_app)
    assert [c.action for c in first] == ["create", "disable", "enable", "disable"]
    assert [c.action for c in second] == ["create", "enable", "disable"]
    assert all(c.changed_by == "alice (django admin)" for c in first[1:] + second[1:])
    assert first[1].new is not None
    assert first[1].new["enabled"] is False

    # delete_selected is a queryset delete: its signals are audited too
    response = alice.post(TASKS, {"action": "delete_selected", "_selected_action": pks, "index": "0", "post": "yes"})
    assert response.status_code == 302
    assert _changes("bulk-0", dcb_app)[-1].action == "delete"
    assert _changes("bulk-1", dcb_app)[-1].changed_by == "alice (django admin)"


def test_a_beat_backend_that_is_down_never_fails_the_save(
    make_app: Callable[..., Celery], settings: Any, alice: Client, caplog: pytest.LogCaptureFixture
) -> None:
    from django_celery_beat.models import PeriodicTask

    down = make_app(
        "dcb-audit-down",
        safe_time_store_url="django",
        safe_time_redis_url=f"redis://127.0.0.1:{free_port()}/0",
        safe_time_key_prefix="dcbd:",
    )
    settings.SAFE_TIME_CELERY_APP = down
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.contrib.django.audit"):
        row = PeriodicTask.objects.create(name="tenant-3", task="reports.send", interval=_every(5))
        row.enabled = False
        row.save()
        response = alice.post(TASKS, {"action": "enable_tasks", "_selected_action": [str(row.pk)], "index": "0"})
        assert response.status_code == 302
        row.delete()
    assert not PeriodicTask.objects.filter(name="tenant-3").exists()
    warnings = [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(warnings) == 4  # create, disable, enable (the action), delete
    assert all("'tenant-3'" in r.getMessage() for r in warnings)


def test_a_projects_admin_overriding_an_action_records_each_change_once(dcb_app: Celery) -> None:
    from django.contrib import admin
    from django.contrib.messages.storage.fallback import FallbackStorage
    from django.test import RequestFactory
    from django_celery_beat.admin import PeriodicTaskAdmin
    from django_celery_beat.models import PeriodicTask

    from celery_safe_time.contrib.django.audit import audit_admin

    class ProjectAdmin(PeriodicTaskAdmin):  # type: ignore[misc]
        def disable_tasks(self, request: Any, queryset: Any) -> Any:
            return super().disable_tasks(request, queryset)

    audit_admin(ProjectAdmin)
    PeriodicTask.objects.create(name="own-admin", task="reports.send", interval=_every(5))
    request = RequestFactory().post(TASKS)
    request.user = User.objects.create_superuser("bob", "bob@example.com", "pw")
    request.session = {}  # type: ignore[assignment]
    request._messages = FallbackStorage(request)  # type: ignore[attr-defined]
    ProjectAdmin(PeriodicTask, admin.site).disable_tasks(request, PeriodicTask.objects.filter(name="own-admin"))
    changes = _changes("own-admin", dcb_app)
    assert [c.action for c in changes] == ["create", "disable"]
    assert changes[1].changed_by == "bob (django admin)"


def test_a_deleted_rows_runs_and_changes_expire_on_redis_and_a_recreated_one_keeps_them(dcb_app: Celery) -> None:
    from django_celery_beat.models import PeriodicTask

    from celery_safe_time import constants as C
    from celery_safe_time.beat.backends import beat_backend
    from celery_safe_time.beat.backends.redis import history_keys
    from celery_safe_time.config import get_config

    config = get_config(dcb_app)
    backend = beat_backend(config)
    backend.history_record("tenant-9", 60.0, '{"id":"run-1"}')
    row = PeriodicTask.objects.create(name="tenant-9", task="reports.send", interval=_every(5))
    kept = [config.key(C.KEY_BEAT_AUDIT, entry="tenant-9"), *history_keys(config, "tenant-9")]
    client = backend.client  # type: ignore[attr-defined]
    assert [client.ttl(k) for k in kept] == [-1, -1, -1]  # a live entry's: bounded by size, no expiry
    row.delete()
    ttls = [client.ttl(k) for k in kept]
    assert all(0 < t <= C.BEAT_DELETED_HISTORY_KEEP for t in ttls), ttls
    PeriodicTask.objects.create(name="tenant-9", task="reports.send", interval=_every(5))
    assert [client.ttl(k) for k in kept] == [-1, -1, -1]
    assert [c.action for c in _changes("tenant-9", dcb_app)] == ["create", "delete", "create"]
