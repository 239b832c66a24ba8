"""The Django contrib app: migrations, admin, and SafeTask on the Django ORM store."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import redis
from celery import Celery
from django.core.management import call_command
from django.test import Client

from celery_safe_time import cancel
from celery_safe_time import constants as C
from celery_safe_time.contrib.django.models import DelayedTask
from celery_safe_time.contrib.django.store import DjangoStore
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import new_delay, runs
from tests.helpers.processes import ProcessManager, wait_for

DJANGO_APP = "tests.apps.delays_django_app"

pytestmark = pytest.mark.integration


@pytest.mark.django_db
def test_makemigrations_is_clean() -> None:
    out = io.StringIO()
    call_command("makemigrations", "celery_safe_time", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db
def test_migrated_table_has_the_partial_indexes() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [C.DELAY_TABLE])
        indexes = dict(cursor.fetchall())
    assert "WHERE ((status)::text = 'pending'::text)" in indexes[C.DELAY_DUE_INDEX]
    assert "UNIQUE" in indexes[C.DELAY_KEY_INDEX]


@pytest.mark.django_db(transaction=True)
def test_admin_changelist_filters_search_and_cancel_action(admin_client: Client) -> None:
    store = DjangoStore()
    now = store.now()
    store.insert(new_delay("adm-1", now + timedelta(hours=1), idempotency_key="invoice-7"))
    store.insert(new_delay("adm-2", now + timedelta(hours=2), task="tests.delays.add"))
    url = "/admin/celery_safe_time/delayedtask/"
    page = admin_client.get(url)
    assert page.status_code == 200
    body = page.content.decode()
    assert "adm-1" in body
    assert "adm-2" in body
    filtered = admin_client.get(url, {"task": "tests.delays.add", "status": "pending"}).content.decode()
    assert "adm-2" in filtered
    assert "adm-1" not in filtered
    searched = admin_client.get(url, {"q": "invoice-7"}).content.decode()
    assert "adm-1" in searched
    assert "adm-2" not in searched
    detail = admin_client.get(f"{url}adm-1/change/")
    assert detail.status_code == 200
    selected = {"action": "cancel_pending", "_selected_action": ["adm-1"]}
    assert "Cancel delayed tasks?" in admin_client.post(url, selected).content.decode()  # a confirmation first
    assert DelayedTask.objects.get(id="adm-1").status == C.STATUS_PENDING
    response = admin_client.post(url, {**selected, "post": "yes"}, follow=True)
    assert response.status_code == 200
    assert "Cancelled 1 delayed task(s) that had not started" in response.content.decode()
    assert DelayedTask.objects.get(id="adm-1").status == C.STATUS_CANCELLED
    assert DelayedTask.objects.get(id="adm-2").status == C.STATUS_PENDING


@pytest.mark.django_db(transaction=True)
def test_safetask_on_the_django_store(make_app: Callable[..., Celery]) -> None:
    app = make_app("django-store", safe_time_store_url="django", safe_time_delay_threshold=60)
    define_tasks(app)
    store = get_store(app)
    assert isinstance(store, DjangoStore)
    result = app.tasks["tests.delays.record"].apply_async(("dj",), countdown=3600)
    row = DelayedTask.objects.get(id=result.id)
    assert row.status == C.STATUS_PENDING
    assert store.reschedule(result.id, store.now() - timedelta(seconds=1))
    stats = sweep(app)
    assert stats.sent == 1
    assert DelayedTask.objects.get(id=result.id).status == C.STATUS_SENT


@pytest.mark.django_db(transaction=True)
def test_worker_and_beat_on_the_django_store(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    from django.db import connection

    db = connection.settings_dict
    db_url = f"postgresql://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    conf = {"broker_transport_options": {"visibility_timeout": 3}, "safe_time_sweep_interval": 1}
    env = {
        "SAFE_TIME_TEST_DJANGO_DB_URL": db_url,
        "SAFE_TIME_TEST_STORE_URL": "",
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }
    processes.worker(DJANGO_APP, name="djw", env=env).wait_for_log(r"ready\.", timeout=90)
    processes.beat(DJANGO_APP, name="djbeat", env=env, scheduler="celery.beat:PersistentScheduler")
    app = make_app("django-worker", safe_time_store_url="django", **conf)
    define_tasks(app)
    result = app.tasks["tests.delays.record"].apply_async(("django",), countdown=5)
    cancelled = app.tasks["tests.delays.record"].apply_async(("cancelled",), countdown=5)
    assert DelayedTask.objects.get(id=result.id).status == C.STATUS_PENDING
    assert cancel(cancelled.id, app=app)
    wait_for(lambda: runs(redis_client), timeout=60, message="stored task ran from the Django store")
    time.sleep(2)
    done = runs(redis_client)
    assert [r["task_id"] for r in done] == [result.id]
    record = DelayedTask.objects.get(id=result.id)
    assert (record.status, record.outcome, record.starts) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED, 1)
    assert record.worker
    assert record.started_at
    assert record.finished_at
    assert DelayedTask.objects.get(id=cancelled.id).status == C.STATUS_CANCELLED


def _terminate_django_backend() -> None:
    """Kill the default alias's PostgreSQL backend from another session, as a database restart would."""
    import psycopg
    from django.db import connection

    pid = connection.connection.info.backend_pid
    s = connection.settings_dict
    with psycopg.connect(
        host=s["HOST"], port=s["PORT"], user=s["USER"], password=s["PASSWORD"], dbname=s["NAME"], autocommit=True
    ) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.django_db(transaction=True)
def test_mark_sent_after_a_killed_connection_is_retried_and_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    from celery_safe_time.delays.publish import mark_sent_retrying
    from celery_safe_time.exceptions import StoreError

    store = DjangoStore()
    store.insert(new_delay("killed-conn", store.now() - timedelta(seconds=1)))
    assert [r.id for r in store.claim_due(limit=10, lookahead=0, token="tok")] == ["killed-conn"]
    _terminate_django_backend()
    # A call outside a transaction meets the dead connection first (a database restart between
    # the publish and mark_sent): it must not leave the dead connection for the retries.
    with pytest.raises(StoreError):
        store.get("killed-conn")
    with caplog.at_level("WARNING"):
        assert mark_sent_retrying(store, ["killed-conn"], "tok", budget=3.0) == 1
    assert DelayedTask.objects.get(id="killed-conn").status == C.STATUS_SENT


@pytest.mark.django_db(transaction=True)
def test_a_dead_connection_is_one_store_error_and_the_next_call_reconnects() -> None:
    from celery_safe_time.exceptions import StoreError

    store = DjangoStore()
    store.now()
    _terminate_django_backend()
    errors = 0
    for _ in range(3):  # now() is a bare cursor, outside any atomic block
        try:
            store.now()
            break
        except StoreError:
            errors += 1
    assert errors == 1
    assert store.counts()[C.STATUS_PENDING] == 0


@pytest.mark.django_db
def test_interface_error_is_a_store_error() -> None:
    # psycopg2 says "connection already closed" as InterfaceError, which is not a DatabaseError.
    from django.db import InterfaceError

    from celery_safe_time.exceptions import StoreError

    store = DjangoStore()
    with pytest.raises(StoreError, match="InterfaceError: connection already closed"), store._errors():
        raise InterfaceError("connection already closed")
