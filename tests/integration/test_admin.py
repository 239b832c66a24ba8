"""The Django admin's stored-delay pages and "Safe time" overview, through Django's test client.

Real PostgreSQL (pytest-django's test database) and the test's real Redis db; the browser tests
(``test_admin_browser.py``) drive the same pages in Chromium.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery
from django.test import Client

from celery_safe_time import constants as C
from celery_safe_time import crontab
from celery_safe_time.contrib.django.admin import PICKLE_NOT_DECODED
from celery_safe_time.contrib.django.chart import hour_start
from celery_safe_time.contrib.django.models import DelayedTask
from celery_safe_time.contrib.django.store import DjangoStore
from tests.helpers.admin import hold_lease, hold_lock
from tests.helpers.delays import new_delay
from tests.helpers.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

CHANGELIST = "/admin/celery_safe_time/delayedtask/"
OVERVIEW = CHANGELIST + "overview/"


@pytest.fixture
def admin_app(make_app: Callable[..., Celery], settings: Any) -> Celery:
    app = make_app("admin-views", safe_time_store_url="django", safe_time_key_prefix="adm:")
    settings.SAFE_TIME_CELERY_APP = app
    return app


def _call(*args: Any, **kwargs: Any) -> bytes:
    return json.dumps({"args": list(args), "kwargs": kwargs, "options": {}}).encode()


class _Tripwire:
    """Unpickling this touches ``path``: proof that a page loaded the pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_changelist_shows_decoded_arguments_truncated_and_never_a_pickle(admin_client: Client, tmp_path: Path) -> None:
    store = DjangoStore()
    now = store.now()
    store.insert(new_delay("args-1", now + timedelta(hours=1), payload=_call(42, "trial-ending", lang="de")))
    store.insert(new_delay("args-long", now + timedelta(hours=2), payload=_call("x" * 500)))
    # A pickle that would run code if loaded: the page must show it is not decoded, and not load it.
    tripwire = tmp_path / "unpickled"
    evil = pickle.dumps({"args": [_Tripwire(tripwire)], "kwargs": {}, "options": {}})
    store.insert(
        new_delay("args-pickle", now + timedelta(hours=3), payload=evil, content_type="application/x-python-serialize")
    )
    body = admin_client.get(CHANGELIST).content.decode()
    assert "42, &quot;trial-ending&quot;, lang=&quot;de&quot;" in body
    assert "x" * 200 not in body  # cut to the column's width
    assert "x" * 70 + "\u2026" in body or "x" * 70 + "&hellip;" in body
    assert PICKLE_NOT_DECODED in body
    detail = admin_client.get(f"{CHANGELIST}args-pickle/change/").content.decode()
    assert PICKLE_NOT_DECODED in detail
    admin_client.post(CHANGELIST, {"action": "cancel_pending", "_selected_action": ["args-pickle"]})
    assert not tripwire.exists()


def test_changelist_shows_the_delivery_record(admin_client: Client) -> None:
    store = DjangoStore()
    now = store.now()
    store.insert(new_delay("rec-1", now - timedelta(seconds=5)))
    DelayedTask.objects.filter(id="rec-1").update(
        status=C.STATUS_FINISHED,
        outcome=C.OUTCOME_SUCCEEDED,
        worker="celery@worker-7",
        starts=2,
        started_at=now - timedelta(seconds=4),
        finished_at=now - timedelta(seconds=1),
    )
    body = admin_client.get(CHANGELIST).content.decode()
    for text in ("celery@worker-7", C.OUTCOME_SUCCEEDED, "column-started_at", "column-finished_at", "column-starts"):
        assert text in body


def test_changelist_and_row_page_show_a_debounced_rows_key_and_cap(admin_client: Client) -> None:
    store = DjangoStore()
    key = C.DEBOUNCE_KEY_PREFIX + "tests.index:index:42"
    first = dataclasses.replace(new_delay("deb-1", None, idempotency_key=key), countdown=60.0, debounce_max_wait=300.0)  # type: ignore[arg-type]
    assert store.debounce(first).created
    assert store.debounce(dataclasses.replace(first, id="deb-2")).task_id == "deb-1"
    store.insert(new_delay("plain-1", store.now() + timedelta(hours=1)))
    body = admin_client.get(CHANGELIST).content.decode()
    assert "column-debounce" in body
    assert "tests.index:index:42" in body
    detail = admin_client.get(f"{CHANGELIST}deb-1/change/").content.decode()
    assert "tests.index:index:42" in detail
    assert "field-debounce_until" in detail
    assert admin_client.get(CHANGELIST, {"q": "index:42"}).content.decode().count("deb-1") >= 1


def test_filters_by_status_task_and_due_and_search_by_key(admin_client: Client) -> None:
    store = DjangoStore()
    now = store.now()
    store.insert(new_delay("f-overdue", now - timedelta(minutes=5), idempotency_key="invoice-9"))
    store.insert(new_delay("f-soon", now + timedelta(minutes=30), task="tests.delays.add"))
    store.insert(new_delay("f-later", now + timedelta(days=9)))

    def ids(**params: str) -> set[str]:
        body = admin_client.get(CHANGELIST, params).content.decode()
        return {i for i in ("f-overdue", "f-soon", "f-later") if f"{i}/change/" in body}

    assert ids() == {"f-overdue", "f-soon", "f-later"}
    assert ids(due="overdue") == {"f-overdue"}
    assert ids(due="1h") == {"f-soon"}
    assert ids(due="later") == {"f-later"}
    assert ids(task="tests.delays.add") == {"f-soon"}
    assert ids(status__exact=C.STATUS_PENDING, q="invoice-9") == {"f-overdue"}
    assert ids(q="f-later") == {"f-later"}


def test_cancel_asks_for_confirmation_then_cancels_only_unstarted_rows(admin_client: Client, admin_app: Celery) -> None:
    store = DjangoStore()
    now = store.now()
    store.insert(new_delay("c-1", now + timedelta(hours=1)))
    store.insert(new_delay("c-2", now + timedelta(hours=1)))
    DelayedTask.objects.filter(id="c-2").update(status=C.STATUS_STARTED)
    selected = {"action": "cancel_pending", "_selected_action": ["c-1", "c-2"]}
    page = admin_client.post(CHANGELIST, selected)
    assert page.status_code == 200
    body = page.content.decode()
    assert "Cancel delayed tasks?" in body
    assert "(left as is)" in body  # c-2 started: it is listed, and will not change
    assert DelayedTask.objects.get(id="c-1").status == C.STATUS_PENDING  # nothing changed yet
    done = admin_client.post(CHANGELIST, {**selected, "post": "yes"}, follow=True)
    assert "Cancelled 1 delayed task(s) that had not started" in done.content.decode()
    assert DelayedTask.objects.get(id="c-1").status == C.STATUS_CANCELLED
    assert DelayedTask.objects.get(id="c-2").status == C.STATUS_STARTED
    # As cancel(): the cancelled call reports REVOKED, as a revoked Celery task.
    assert admin_app.AsyncResult("c-1").state == "REVOKED"
    assert admin_app.AsyncResult("c-2").state == "PENDING"


def test_rerun_asks_for_confirmation_then_sends_failed_and_expired_rows_back_to_pending(admin_client: Client) -> None:
    store = DjangoStore()
    past = store.now() - timedelta(seconds=1)
    for task_id in ("f-1", "x-1", "p-1"):
        store.insert(new_delay(task_id, past))
    DelayedTask.objects.filter(id="p-1").update(due_at=past + timedelta(hours=1))
    store.claim_due(limit=10, lookahead=0, token="t")
    assert store.mark_failed("f-1", "t", "NotRegistered: tests.delays.record")
    assert store.mark_expired(["x-1"], "t") == 1
    selected = {"action": "rerun_failed", "_selected_action": ["f-1", "x-1", "p-1"]}
    page = admin_client.post(CHANGELIST, selected)
    assert page.status_code == 200
    body = page.content.decode()
    assert "Run delayed tasks again?" in body
    assert body.count("(left as is)") == 1  # p-1 is pending: listed, and will not change
    assert DelayedTask.objects.get(id="f-1").status == C.STATUS_FAILED  # nothing changed yet
    done = admin_client.post(CHANGELIST, {**selected, "post": "yes"}, follow=True)
    assert "2 failed or expired delayed task(s) are pending again, due now" in done.content.decode()
    assert {row.id: row.status for row in DelayedTask.objects.all()} == dict.fromkeys(
        ("f-1", "x-1", "p-1"), C.STATUS_PENDING
    )
    assert sorted(row.id for row in store.claim_due(limit=10, lookahead=0, token="u")) == ["f-1", "x-1"]


def test_select_all_is_confirmed_with_a_short_list_and_carried_on(admin_client: Client, monkeypatch: Any) -> None:
    from celery_safe_time.contrib.django import admin as admin_module

    monkeypatch.setattr(admin_module, "CONFIRM_LIST_ROWS", 2)
    store = DjangoStore()
    now = store.now()
    for i in range(5):
        store.insert(new_delay(f"all-{i}", now + timedelta(hours=1, minutes=i), task="tests.delays.add"))
    store.insert(new_delay("other", now + timedelta(hours=1)))
    url = CHANGELIST + "?task=tests.delays.add"
    selected = {"action": "cancel_pending", "select_across": "1", "_selected_action": ["all-0"], "index": "0"}
    body = admin_client.post(url, selected).content.decode()
    assert "and 3 more (5 selected)" in body
    assert 'name="select_across" value="1"' in body
    assert 'name="_selected_action" value="all-0"' in body
    admin_client.post(
        url, {"action": "cancel_pending", "select_across": "1", "_selected_action": ["all-0"], "post": "yes"}
    )
    statuses = dict(DelayedTask.objects.values_list("id", "status"))
    assert [statuses[f"all-{i}"] for i in range(5)] == [C.STATUS_CANCELLED] * 5
    assert statuses["other"] == C.STATUS_PENDING  # outside the filter the selection was made in


def test_a_view_only_user_gets_no_actions(client: Client) -> None:
    from django.contrib.auth.models import Permission, User

    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_delayedtask"))
    client.force_login(viewer)
    store = DjangoStore()
    store.insert(new_delay("v-1", store.now() + timedelta(hours=1)))
    body = client.get(CHANGELIST).content.decode()
    assert "v-1" in body
    assert "cancel_pending" not in body
    client.post(CHANGELIST, {"action": "cancel_pending", "_selected_action": ["v-1"], "post": "yes"})
    assert DelayedTask.objects.get(id="v-1").status == C.STATUS_PENDING


def test_reschedule_asks_for_the_new_due_time(admin_client: Client) -> None:
    store = DjangoStore()
    now = store.now()
    store.insert(new_delay("r-1", now + timedelta(hours=1)))
    token = DelayedTask.objects.get(id="r-1").delivery_token
    selected = {"action": "reschedule_pending", "_selected_action": ["r-1"]}
    form = admin_client.post(CHANGELIST, selected).content.decode()
    assert 'type="datetime-local"' in form
    assert "New due time (UTC)" in form
    bad = admin_client.post(CHANGELIST, {**selected, "post": "yes", "due_at": "next tuesday"}).content.decode()
    assert "Enter a valid date/time" in bad
    target = (now + timedelta(days=3)).replace(microsecond=0)
    done = admin_client.post(
        CHANGELIST, {**selected, "post": "yes", "due_at": target.strftime("%Y-%m-%dT%H:%M:%S")}, follow=True
    )
    assert "Rescheduled 1 delayed task(s)" in done.content.decode()
    row = DelayedTask.objects.get(id="r-1")
    assert row.due_at == target
    assert row.status == C.STATUS_PENDING
    assert row.delivery_token != token  # a copy already sent for the old time is stale now


def test_detail_page_is_read_only(admin_client: Client) -> None:
    store = DjangoStore()
    store.insert(new_delay("ro-1", store.now() + timedelta(hours=1), payload=_call(7)))
    page = admin_client.get(f"{CHANGELIST}ro-1/change/")
    assert page.status_code == 200
    body = page.content.decode()
    assert 'name="_save"' not in body
    assert "&quot;args&quot;: [\n    7\n  ]" in body  # the whole decoded call
    posted = admin_client.post(f"{CHANGELIST}ro-1/change/", {"status": C.STATUS_CANCELLED})
    assert posted.status_code == 403
    assert DelayedTask.objects.get(id="ro-1").status == C.STATUS_PENDING


def test_overview_shows_an_invalid_entry_with_its_reason_not_a_next_fire(
    admin_client: Client, admin_app: Celery
) -> None:
    # Issue 40, trap 4: the overview showed a next fire time for an entry the leader disables.
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    admin_app.conf.beat_schedule = {
        "typo": {"task": "tests.nightly", "schedule": 3600.0, "options": {"overlap": "sikp"}},
        "nightly": {"task": "tests.nightly", "schedule": 3600.0},
    }
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.MINUTES)
    PeriodicTask.objects.create(name="db-typo", task="tests.db", interval=every, headers='{"safe_time_overlap": "x"}')
    body = admin_client.get(OVERVIEW).content.decode()
    assert body.count("invalid: ") == 2, body
    assert "invalid: invalid entry: ScheduleError: entry &#x27;typo&#x27;: safe_time_overlap must be one of" in body
    assert "invalid: safe_time_overlap must be one of" in body  # the django-celery-beat row
    nightly = body[body.index(">nightly<") :].split("</tr>")[0]
    assert "invalid" not in nightly  # its task is the worker's to know, not the web server's


def test_overview_shows_leader_entries_delays_chart_and_locks(
    admin_client: Client, admin_app: Celery, redis_client: redis.Redis
) -> None:
    from celery_safe_time.beat.entries import pause, save_entry

    admin_app.conf.beat_schedule = {"nightly": {"task": "tests.nightly", "schedule": 3600.0}}

    @admin_app.task(name="tests.report", shared=False)
    def report() -> None:
        pass

    save_entry("paused-report", "tests.report", 3600.0, app=admin_app)
    paused = pause("paused-report", note="db migration", until=timedelta(hours=2), app=admin_app)
    assert paused is not None
    assert paused.paused_until is not None
    hold_lease(admin_app, host="beat-host-1", pid=4242)
    hold_lock(admin_app, "inventory-sync:3", task_id="sync-task-1", host="worker-host-2")
    store = DjangoStore()
    now = store.now()
    hour = hour_start(now)
    store.insert(new_delay("o-late", hour - timedelta(hours=2)))
    for i in range(3):
        store.insert(new_delay(f"o-{i}", hour + timedelta(hours=5, minutes=i)))
    store.insert(new_delay("o-far", hour + timedelta(hours=30)))
    store.insert(new_delay("o-fail", now + timedelta(hours=1)))
    DelayedTask.objects.filter(id="o-fail").update(status=C.STATUS_FAILED)
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.MINUTES)
    PeriodicTask.objects.create(name="db-entry", task="tests.db", interval=every, last_run_at=now)
    cron = CrontabSchedule.objects.create(minute="30", hour="2", timezone=ZoneInfo("America/New_York"))
    PeriodicTask.objects.create(name="db-cron", task="tests.db", crontab=cron, last_run_at=now)
    next_cron = crontab(minute=30, hour=2, tz="America/New_York").next_after(now)

    page = admin_client.get(OVERVIEW)
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="leader-host">beat-host-1<' in body
    assert 'id="leader-pid">4242<' in body
    assert re.search(r'id="leader-age">\d+\.\d s<', body)  # how long it has led, from the lease's "since"
    assert "no-leader" not in body
    assert "nightly" in body
    assert f"paused: db migration (until {paused.paused_until.strftime('%Y-%m-%d %H:%M:%S')})" in body
    assert "db-entry" in body
    next_db = (now + timedelta(minutes=10)).strftime("%Y-%m-%d %H:%M")
    assert next_db in body  # the database entry's next fire, one interval after its last run
    assert next_cron.strftime("%Y-%m-%d %H:%M:%S") in body  # 02:30 New York time, in UTC
    assert 'id="delays-pending">5<' in body
    assert 'id="delays-failed" class="bad">1<' in body
    assert "s late" in body
    assert body.count('class="bar"') == 2  # hour +5 (3 rows) and hour +30; o-late is before this hour
    assert 'data-count="3"' in body
    assert "1 pending delay(s) were due before this hour" in body
    assert "inventory-sync:3" in body
    assert "sync-task-1" in body
    assert "worker-host-2" in body


def test_overview_shows_flow_control(admin_client: Client, admin_app: Celery) -> None:
    from celery_safe_time.locks.backends import get_lock_backend
    from celery_safe_time.locks.rates import Rate

    prefix = f"flow-{uuid.uuid4().hex[:8]}"
    hold_lock(admin_app, f"slot:{prefix}-export:7#0", task_id="slot-a", host="w1")
    hold_lock(admin_app, f"slot:{prefix}-export:7#2", task_id="slot-b", host="w2")
    backend = get_lock_backend(admin_app)
    for n in range(3):
        backend.rate_take(f"{prefix}-stripe:1", f"t{n}", Rate(2, 60.0))
    store = DjangoStore()
    key = C.DEBOUNCE_KEY_PREFIX + "tests.index:index:7"
    burst = dataclasses.replace(new_delay("flow-deb", None, idempotency_key=key), countdown=60.0)  # type: ignore[arg-type]
    assert store.debounce(burst).created
    store.insert(new_delay("flow-plain", store.now() + timedelta(hours=1)))
    body = admin_client.get(OVERVIEW).content.decode()
    assert 'id="flow"' in body
    assert re.search(r'id="flow-slots">[1-9]\d*<', body)
    assert f'<td>{prefix}-export:7</td><td class="num">2</td>' in body
    assert f'<td>{prefix}-stripe:1</td><td class="num">2</td><td class="num">1</td>' in body
    assert re.search(r'id="flow-waiting">[1-9]\d*<', body)
    assert 'id="delays-debounced">1<' in body
    assert 'id="flow-debounced">1<' in body


def test_overview_without_a_leader_says_so_in_red(admin_client: Client, admin_app: Celery) -> None:
    body = admin_client.get(OVERVIEW).content.decode()
    assert 'class="bad" id="no-leader"' in body
    assert 'id="chart-empty"' in body
    assert "No locks held." in body
    assert "No concurrency slot held." in body


def test_overview_with_redis_down_is_a_red_message_not_a_500(
    admin_client: Client, make_app: Callable[..., Celery], settings: Any
) -> None:
    app = make_app(
        "admin-no-redis", safe_time_store_url="django", safe_time_redis_url=f"redis://127.0.0.1:{free_port()}/0"
    )
    settings.SAFE_TIME_CELERY_APP = app
    DjangoStore().insert(new_delay("down-1", DjangoStore().now() + timedelta(hours=2)))
    page = admin_client.get(OVERVIEW)
    assert page.status_code == 200
    body = page.content.decode()
    redis_url = app.conf.safe_time_redis_url
    assert f'id="beat-error">Beat unavailable: redis {redis_url} unreachable' in body
    assert 'id="locks-error">Locks unavailable: Redis unreachable' in body
    assert 'id="delays-pending">1<' in body  # the database sections still render
    assert 'class="bar"' in body


@pytest.fixture
def store_coordination() -> Iterator[dict[str, str]]:
    """Coordination in the Django database (``"store"``), under a key prefix of this test's own; the
    pooled connections are closed afterwards (pytest-django drops the test database at the end)."""
    yield {"safe_time_coordination_url": "store", "safe_time_key_prefix": f"adm{uuid.uuid4().hex[:8]}:"}
    from celery_safe_time.coordination import dispose_engines

    dispose_engines()


def test_overview_on_postgres_coordination_shows_the_lease_holder(
    admin_client: Client, make_app: Callable[..., Celery], settings: Any, store_coordination: dict[str, str]
) -> None:
    """Issue 18: with ``safe_time_coordination_url = "store"`` (the Django database, no Redis) the
    leader, its epoch and the entries are read from the lease and state rows."""
    app = make_app(
        "admin-pg",
        safe_time_store_url="django",
        beat_schedule={"nightly": {"task": "tests.nightly", "schedule": 3600.0}},
        **store_coordination,
    )
    settings.SAFE_TIME_CELERY_APP = app
    assert 'class="bad" id="no-leader"' in admin_client.get(OVERVIEW).content.decode()
    lease = hold_lease(app, host="pg-beat-host", pid=5151)
    page = admin_client.get(OVERVIEW)
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="leader-host">pg-beat-host<' in body
    assert 'id="leader-pid">5151<' in body
    assert f'id="leader-epoch">{lease.epoch}<' in body
    assert re.search(r'id="leader-age">\d+\.\d s<', body)
    assert "no-leader" not in body
    assert "beat-error" not in body
    assert "nightly" in body
    assert "No locks held." in body  # the locks are on PostgreSQL too
    assert lease.release()
    assert 'class="bad" id="no-leader"' in admin_client.get(OVERVIEW).content.decode()


def test_overview_with_the_coordination_database_down_is_a_red_message_not_a_500(
    admin_client: Client, make_app: Callable[..., Celery], settings: Any
) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere"
    app = make_app("admin-pg-down", safe_time_store_url="django", safe_time_coordination_url=url)
    settings.SAFE_TIME_CELERY_APP = app
    DjangoStore().insert(new_delay("pg-down-1", DjangoStore().now() + timedelta(hours=2)))
    page = admin_client.get(OVERVIEW)
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="beat-error">Beat unavailable: postgresql postgresql+psycopg://postgres@127.0.0.1:' in body
    assert 'id="locks-error">Locks unavailable: ' in body
    assert 'id="delays-pending">1<' in body


def test_the_app_index_and_the_changelist_link_the_overview(admin_client: Client, admin_app: Celery) -> None:
    assert OVERVIEW in admin_client.get("/admin/celery_safe_time/").content.decode()
    assert OVERVIEW in admin_client.get(CHANGELIST).content.decode()


def test_overview_needs_a_staff_login(client: Client, admin_app: Celery) -> None:
    page = client.get(OVERVIEW)
    assert page.status_code == 302
    assert "/admin/login/" in page["Location"]


def test_overview_needs_the_view_permission(client: Client, admin_app: Celery) -> None:
    from django.contrib.auth.models import Permission, User

    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(staff)
    assert client.get(OVERVIEW).status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_delayedtask"))
    assert client.get(OVERVIEW).status_code == 200


def test_the_admin_app_setting_takes_a_dotted_path(settings: Any) -> None:
    from celery_safe_time.contrib.django.overview import celery_app
    from tests.helpers.admin import DOTTED_APP

    settings.SAFE_TIME_CELERY_APP = "tests.helpers.admin:DOTTED_APP"
    assert celery_app() is DOTTED_APP
    settings.SAFE_TIME_CELERY_APP = "tests.helpers.admin.DOTTED_APP"
    assert celery_app() is DOTTED_APP
    settings.SAFE_TIME_CELERY_APP = "tests.helpers.admin.hold_lease"
    with pytest.raises(TypeError, match="is not a Celery app"):
        celery_app()


def test_the_django_overview_lists_every_shard(
    make_app: Callable[..., Celery], settings: Any, admin_client: Client
) -> None:
    from celery_safe_time.beat.backends import beat_backend
    from celery_safe_time.config import get_config

    app = make_app(
        "admin-shards", safe_time_store_url="django", safe_time_key_prefix="adm-shards:", safe_time_beat_shards=3
    )
    settings.SAFE_TIME_CELERY_APP = app
    backend = beat_backend(get_config(app))
    for shard in (0, 1):  # shard 2 is held by no beat
        lease = backend.for_shard(shard).make_lease(info={"host": f"beat-host-{shard}", "pid": 4000 + shard})
        assert lease.acquire(backend.clock.time()) is not None
    body = admin_client.get(OVERVIEW).content.decode()
    assert 'id="beat-shards"' in body
    assert "beat-host-0 pid 4000" in body
    assert "beat-host-1 pid 4001" in body
    row = body[body.index('id="shard-2"') :]
    assert "no beat holds it" in row[: row.index("</tr>")]
