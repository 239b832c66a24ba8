"""``SafeDatabaseScheduler`` with real beat processes against the PostgreSQL test database."""

from __future__ import annotations

import datetime as dt
import itertools
import time
import uuid
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from django.db import connection
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask, PeriodicTasks

from tests.helpers.beat import beat_env, duplicates, holder_pid, leader_pid, runs
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

APP = "tests.apps.django_beat_app"
SCHEDULER = "celery_safe_time.contrib.django.SafeDatabaseScheduler"
LEASE = 6.0
UTC = dt.timezone.utc


def _db_url() -> str:
    s = connection.settings_dict
    return f"postgresql://{s['USER']}:{s['PASSWORD']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


def _slot(run: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(run["headers"]["safe_time_slot"]).timestamp()


def _start(processes: ProcessManager, n: int, **conf: Any) -> list[CeleryProcess]:
    env = {**beat_env({}, safe_time_beat_lease=LEASE, **conf), "SAFE_TIME_TEST_DJANGO_DB_URL": _db_url()}
    processes.worker(APP, env=env, name="worker")
    return [processes.beat(APP, env=env, name=f"beat{i}", scheduler=SCHEDULER) for i in range(n)]


def test_crontab_rows_use_their_timezone_with_dst_rules(make_app: Any) -> None:
    from celery_safe_time.contrib.django.schedulers import SafeModelEntry

    app = make_app()

    cron = CrontabSchedule.objects.create(minute="30", hour="2", timezone=ZoneInfo("America/New_York"))
    task = PeriodicTask.objects.create(name="ny-0230", task="tests.record", crontab=cron)
    entry = SafeModelEntry(task, app=app)
    after = dt.datetime(2026, 3, 8, tzinfo=UTC)
    assert entry.schedule.next_after(after) == dt.datetime(2026, 3, 8, 7, 0, tzinfo=UTC)  # R1


@pytest.mark.parametrize(("policy", "fired"), [("run_once", [30]), ("skip", []), ("run_all", [10, 20, 30])])
def test_database_entries_follow_the_misfire_policy(make_app: Any, policy: str, fired: list[int]) -> None:
    from celery_safe_time.contrib.django.schedulers import SafeModelEntry

    app = make_app()
    start = dt.datetime(2026, 3, 1, tzinfo=UTC)
    now = start + dt.timedelta(seconds=37)  # S1..S3 (10, 20, 30 s) missed by more than the 6 s window
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    row = PeriodicTask.objects.create(name=f"m-{policy}", task="tests.record", interval=every, last_run_at=start)
    entry_cls = type("E", (SafeModelEntry,), {"clock": staticmethod(lambda: now), "misfire": policy, "on_time": 6.0})
    entry = entry_cls(row, app=app)
    after = next(entry)
    assert [s - start.timestamp() for s in entry.fire_slots or []] == fired
    assert after.last_run_at == start + dt.timedelta(seconds=30)
    assert row.total_run_count == len(fired)


def test_a_row_sets_its_own_misfire_policy_in_its_headers(make_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler, SafeModelEntry

    app = make_app()
    start = dt.datetime(2026, 3, 1, tzinfo=UTC)
    now = start + dt.timedelta(seconds=37)
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    entry_cls = type("E", (SafeModelEntry,), {"clock": staticmethod(lambda: now), "misfire": "run_all", "on_time": 6.0})

    def row(name: str, headers: str) -> PeriodicTask:
        return PeriodicTask.objects.create(
            name=name, task="tests.record", interval=every, last_run_at=start, headers=headers
        )

    skip = entry_cls(row("own-skip", '{"safe_time_misfire": "skip", "x-trace": "1"}'), app=app)
    default = entry_cls(row("default", "{}"), app=app)
    assert skip.misfire == "skip"
    assert default.misfire == "run_all"
    next(skip)
    next(default)
    assert skip.fire_slots == []
    assert [s - start.timestamp() for s in default.fire_slots or []] == [10, 20, 30]
    # the policy is not published with the task's own headers
    assert skip.options["headers"] == {"x-trace": "1", "periodic_task_name": "own-skip"}

    bad = row("bad-policy", '{"safe_time_misfire": "twice"}')
    scheduler = type("S", (), {"Entry": entry_cls, "app": app, "enabled_models": lambda self: [bad, default.model]})()
    with caplog.at_level("ERROR"):
        schedule = SafeDatabaseScheduler.all_as_schedule(scheduler)  # type: ignore[arg-type]
    assert set(schedule) == {"default"}
    assert "entry 'bad-policy' is disabled: headers.safe_time_misfire must be one of" in caplog.text


def test_a_row_sets_its_catch_up_window_in_its_headers(make_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    from celery_safe_time.beat.policies import beat_slots_past_catchup
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler, SafeModelEntry

    app = make_app()
    start = dt.datetime(2026, 3, 1, tzinfo=UTC)
    now = start + dt.timedelta(seconds=37)  # S1..S3 (10, 20, 30 s) are 27, 17 and 7 s late
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    entry_cls = type("E", (SafeModelEntry,), {"clock": staticmethod(lambda: now), "misfire": "run_all", "on_time": 6.0})

    def row(name: str, headers: str) -> PeriodicTask:
        return PeriodicTask.objects.create(
            name=name, task="tests.record", interval=every, last_run_at=start, headers=headers
        )

    counted: list[tuple[str, int]] = []

    def on_skipped(sender: Any, entry: str, count: int, **kw: Any) -> None:
        counted.append((entry, count))

    beat_slots_past_catchup.connect(on_skipped, weak=False)
    try:
        windowed = entry_cls(row("windowed", '{"safe_time_catchup_window": 15, "x-trace": "1"}'), app=app)
        next(windowed)
    finally:
        beat_slots_past_catchup.disconnect(on_skipped)
    assert [s - start.timestamp() for s in windowed.fire_slots or []] == [30]  # run_all, within 15 s only
    assert counted == [("windowed", 2)]
    assert windowed.options["headers"] == {"x-trace": "1", "periodic_task_name": "windowed"}

    bad = row("bad-window", '{"safe_time_catchup_window": 0}')
    jittered = row("jittered", '{"safe_time_jitter": 30}')  # not shorter than the 10 s interval
    scheduler = type(
        "S", (), {"Entry": entry_cls, "app": app, "enabled_models": lambda self: [bad, jittered, windowed.model]}
    )()
    with caplog.at_level("ERROR"):
        schedule = SafeDatabaseScheduler.all_as_schedule(scheduler)  # type: ignore[arg-type]
    assert set(schedule) == {"windowed"}
    assert "entry 'bad-window' is disabled: headers.safe_time_catchup_window must be above 0 seconds" in caplog.text
    assert "entry 'jittered' is disabled: headers.safe_time_jitter (30 s) must be shorter than its interval" in (
        caplog.text
    )


def test_a_row_sets_its_jitter_in_its_headers(make_app: Any) -> None:
    """Each slot waits for its offset (a hash of the row's name and slot, the same in every beat);
    the slot keeps its identity: the fired slot and the row's last_run_at are the slot itself."""
    from celery_safe_time.beat.policies import jitter_offset
    from celery_safe_time.contrib.django.schedulers import SafeModelEntry

    app = make_app()
    start = dt.datetime(2026, 3, 1, tzinfo=UTC)
    slot = start + dt.timedelta(minutes=1)
    minutely = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    row = PeriodicTask.objects.create(
        name="jittered", task="tests.record", interval=minutely, last_run_at=start, headers='{"safe_time_jitter": 30}'
    )
    offset = jitter_offset("jittered", slot.timestamp(), 30.0)
    assert 0 < offset < 30

    def entry_at(now: dt.datetime) -> SafeModelEntry:
        cls = type("E", (SafeModelEntry,), {"clock": staticmethod(lambda: now), "misfire": "run_once", "on_time": 6.0})
        return cls(row, app=app)

    early = entry_at(slot + dt.timedelta(seconds=offset / 2))
    assert early.jitter == 30.0
    assert early.options["headers"] == {"periodic_task_name": "jittered"}  # the policy is not published
    state = early.is_due()
    assert not state.is_due
    assert state.next == pytest.approx(offset / 2, abs=0.01)  # checked again at its offset
    due = entry_at(slot + dt.timedelta(seconds=offset + 0.5))
    assert due.is_due().is_due
    after = next(due)
    assert due.fire_slots == [slot.timestamp()]  # the slot, not the jittered instant
    assert after.last_run_at == slot
    # offsets spread over the window: 200 rows on the same minute do not share one
    offsets = {jitter_offset(f"row-{i}", slot.timestamp(), 30.0) for i in range(200)}
    assert len(offsets) > 190
    assert min(offsets) < 3
    assert max(offsets) > 27


def test_a_row_enabled_again_by_a_bulk_update_starts_at_its_next_slot(make_app: Any) -> None:
    """django-celery-beat empties last_run_at on disable, and its admin's "enable" action is a bulk
    update that leaves date_changed as it was: the row runs at its next slot, not at once as well."""
    from celery_safe_time.contrib.django.schedulers import SafeModelEntry

    app = make_app()
    start = dt.datetime(2026, 3, 1, tzinfo=UTC)
    now = start + dt.timedelta(hours=5, seconds=30)
    hourly = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.HOURS)
    row = PeriodicTask.objects.create(name="hourly", task="tests.record", interval=hourly, enabled=False)
    PeriodicTask.objects.filter(pk=row.pk).update(enabled=True, date_changed=start)  # the admin action
    row.refresh_from_db()
    assert row.last_run_at is None
    entry_cls = type(
        "E", (SafeModelEntry,), {"clock": staticmethod(lambda: now), "misfire": "run_once", "on_time": 6.0}
    )
    entry = entry_cls(row, app=app)
    assert entry.is_due().is_due  # django-celery-beat's rule: due since start + 1 h
    after = next(entry)
    assert entry.fire_slots == []  # no catch-up run (run_once would have published start + 5 h)
    assert after.last_run_at == start + dt.timedelta(hours=5)
    assert not after.is_due().is_due  # next: start + 6 h
    # a row that ran keeps its misfire policy: the same gap is one catch-up run
    ran = entry_cls(PeriodicTask.objects.create(name="ran", task="tests.record", interval=hourly, last_run_at=start))
    next(ran)
    assert [s - start.timestamp() for s in ran.fire_slots or []] == [5 * 3600]


def test_safe_database_scheduler_end_to_end(
    processes: ProcessManager, redis_client: redis.Redis, django_user_model: Any, client: Any, redis_url: str
) -> None:
    every = IntervalSchedule.objects.create(every=2, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="dj-fast", task="tests.record", interval=every, args='["dj-fast"]')
    # A fixed time in Kolkata (+05:30): it fires at this instant only if the row's timezone is used.
    target = dt.datetime.fromtimestamp((time.time() // 60 + 1) * 60, UTC)
    if (target.timestamp() - time.time()) < 20:
        target += dt.timedelta(minutes=1)
    local = target.astimezone(ZoneInfo("Asia/Kolkata"))
    cron = CrontabSchedule.objects.create(
        minute=str(local.minute), hour=str(local.hour), timezone=ZoneInfo("Asia/Kolkata")
    )
    PeriodicTask.objects.create(name="dj-cron", task="tests.record", crontab=cron, args='["dj-cron"]')

    beats = _start(processes, 2)
    pid = wait_for(lambda: leader_pid(redis_client), 60, message="a leader")
    wait_for(lambda: len(runs(redis_client, "dj-fast")) >= 3, 60, message="dj-fast runs")
    leader = next(b for b in beats if b.pid == pid)
    before = {r["headers"]["safe_time_epoch"] for r in runs(redis_client)}
    leader.kill()
    wait_for(
        lambda: any(r["headers"]["safe_time_epoch"] not in before for r in runs(redis_client)),
        30,
        message="a run from the new leader",
    )
    # an edit (as the admin would make it) is picked up by the leader
    edited_at = time.time()
    every.every = 3
    every.save()
    wait_for(lambda: runs(redis_client, "dj-cron"), max(10.0, target.timestamp() - time.time() + 30), interval=1)
    wait_for(lambda: len([r for r in runs(redis_client, "dj-fast") if _slot(r) > edited_at + 4]) >= 3, 40)
    for beat in beats:
        beat.terminate()
    time.sleep(3)

    assert duplicates(redis_client) == {}
    assert [_slot(r) for r in runs(redis_client, "dj-cron")] == [target.timestamp()]
    fast = sorted(_slot(r) for r in runs(redis_client, "dj-fast"))
    late = [b - a for a, b in itertools.pairwise(fast) if a > edited_at + 4]
    assert late
    assert all(g == pytest.approx(3.0) for g in late), late
    row = PeriodicTask.objects.get(name="dj-fast")
    assert row.total_run_count == len(fast)
    assert row.last_run_at.timestamp() == pytest.approx(fast[-1])
    assert PeriodicTask.objects.get(name="dj-cron").total_run_count == 1
    # each run is in the row's run history, under the task id it ran as, its outcome filled in
    from celery import Celery

    from celery_safe_time import entry_history

    reader = Celery("reader", set_as_current=False)
    reader.conf.update(broker_url=redis_url, safe_time_redis_url=redis_url)
    recorded = {r["task_id"] for r in runs(redis_client, "dj-fast")}
    history = entry_history("dj-fast", app=reader)
    assert history
    assert {r.task_id for r in history} <= recorded
    outcomes = {r.outcome for r in history}
    assert "succeeded" in outcomes
    assert outcomes <= {"succeeded", "published"}  # the last one may not have been reported yet

    admin = django_user_model.objects.create_superuser("admin", "a@example.com", "pw")
    client.force_login(admin)
    page = client.get("/admin/django_celery_beat/periodictask/")
    assert page.status_code == 200
    assert b"dj-fast" in page.content


def test_a_new_lease_with_a_repeated_epoch_rereads_the_tables(make_app: Any, redis_client: redis.Redis) -> None:
    from celery_safe_time import signals
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler

    sent: list[tuple[str, float]] = []  # (row, time.time() when published)
    acquired: list[int] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        sent.append((kw["entry"], time.time()))

    def on_acquired(sender: Any, **kw: Any) -> None:
        acquired.append(kw["epoch"])

    def run_ticks(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(max(float(sched.tick()), 0.01), 0.2))

    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="dj-edit", task="tests.record", interval=every, args='["dj-edit"]')
    app = make_app(safe_time_beat_lease=3)
    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    signals.beat_lease_acquired.connect(on_acquired, weak=False)
    try:
        sched = SafeDatabaseScheduler(app=app, max_interval=1)
        try:
            wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
            run_ticks(2.5)
            assert [name for name, _ in sent if name == "dj-edit"]
            redis_client.flushdb()  # Redis restarted without persistence: epochs start again at 1
            # An edit while this beat holds no lease (a bulk update fires no signal, so only a
            # fresh read of the tables sees it; a new leader always reads them afresh).
            PeriodicTask.objects.filter(name="dj-edit").update(enabled=False)
            wait_for(lambda: len(acquired) == 2, 10, message="a new lease")
            assert acquired == [1, 1]  # the same epoch number: not a sign of the same lease
            taken_at = time.time()
            run_ticks(3.0)
        finally:
            sched.close()
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
        signals.beat_lease_acquired.disconnect(on_acquired)
    assert [at for name, at in sent if name == "dj-edit" and at > taken_at] == []


@pytest.fixture
def store_coordination() -> Iterator[dict[str, str]]:
    """Beat coordination in the Django database (the Django store, ``"store"``) under a key prefix of
    this test's own; this process's pooled connections to it are closed afterwards (the test
    database is dropped)."""
    yield {
        "safe_time_store_url": "django",
        "safe_time_coordination_url": "store",
        "safe_time_key_prefix": f"dj{uuid.uuid4().hex[:8]}:",
    }
    from celery_safe_time.coordination import dispose_engines

    dispose_engines()


def test_safe_database_scheduler_on_postgres_coordination_fails_over_without_a_slot_twice(
    processes: ProcessManager, redis_client: redis.Redis, store_coordination: dict[str, str], make_app: Any
) -> None:
    """Issue 18: django-celery-beat's rows, the lease and the fired slots all in the Django database
    (Redis is only the broker and the test's run log). Real beats (30 s: a kill -9 failover is the
    point; the end-to-end test above covers the Redis lease)."""
    from celery_safe_time.beat.backends import beat_backend
    from celery_safe_time.config import get_config

    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="dj-pg", task="tests.record", interval=every, args='["dj-pg"]')
    beats = _start(processes, 2, **store_coordination)
    pid = wait_for(lambda: holder_pid(redis_client, store_coordination), 60, message="a leader")
    wait_for(lambda: len(runs(redis_client, "dj-pg")) >= 3, 60, message="dj-pg runs")
    assert not redis_client.exists(f"{store_coordination['safe_time_key_prefix']}beat:lease")
    leader = next(b for b in beats if b.pid == pid)
    before = {r["headers"]["safe_time_epoch"] for r in runs(redis_client)}
    killed_at = time.time()
    leader.kill()
    wait_for(
        lambda: any(r["headers"]["safe_time_epoch"] not in before for r in runs(redis_client)),
        LEASE + LEASE / 3 + 10,
        message="a run from the new leader",
    )
    took_over = min(float(r["started"]) for r in runs(redis_client) if r["headers"]["safe_time_epoch"] not in before)
    for beat in beats:
        beat.terminate()
    time.sleep(2)
    assert duplicates(redis_client) == {}
    assert took_over - killed_at < LEASE + LEASE / 3 + 2  # the bound, plus a tick and the worker's pickup
    backend = beat_backend(get_config(make_app(**store_coordination)))
    published = {_slot(r): r["headers"]["safe_time_epoch"] for r in runs(redis_client, "dj-pg")}
    row = PeriodicTask.objects.get(name="dj-pg")
    first, last = min(published), row.last_run_at.timestamp()
    grid = [first + k for k in range(round(last - first) + 1)]  # every 1 s slot the beats went through
    marked = {slot for slot in grid if backend.slot_fired("dj-pg", slot)}
    assert set(published) <= marked  # each published slot has its row
    # At most once: a kill -9 between marking a tick's slots fired and publishing them loses those
    # (the killed leader's, before the new leader's first). Nothing else: the beats stopped with
    # SIGTERM publish what they marked before they exit.
    new_first = min(slot for slot, epoch in published.items() if epoch not in before)
    assert all(slot < new_first for slot in marked - set(published)), sorted(marked - set(published))
    # counted per tick after its slots are marked, before they are published
    assert len(published) <= row.total_run_count <= len(marked)


def _ticks(sched: Any, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(max(float(sched.tick()), 0.01), 0.2))


def test_a_row_fired_by_a_new_leaders_first_tick_is_not_reported_fired_twice(
    make_app: Any, redis_client: redis.Redis
) -> None:
    """The row fired by the first tick of a lease is fired once: the ticks after it raise no
    "already fired" alarm (a false one used to come from the table's entry as it was before the run)."""
    from celery_safe_time import signals
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler

    sent: list[str] = []
    alarms: list[tuple[str, str]] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        sent.append(kw["entry"])

    def on_duplicate(sender: Any, **kw: Any) -> None:
        alarms.append((kw["entry"], kw["reason"]))

    hourly = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.HOURS)
    ran = dt.datetime.now(UTC) - dt.timedelta(hours=1, seconds=2)  # its next slot is 2 s late
    PeriodicTask.objects.create(name="dj-due", task="tests.record", interval=hourly, last_run_at=ran)
    app = make_app(safe_time_beat_lease=3)
    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    signals.beat_slot_duplicate.connect(on_duplicate, weak=False)
    try:
        sched = SafeDatabaseScheduler(app=app, max_interval=1)
        try:
            wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
            _ticks(sched, 2.0)
        finally:
            sched.close()
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
        signals.beat_slot_duplicate.disconnect(on_duplicate)
    assert sent.count("dj-due") == 1
    assert alarms == []
    assert PeriodicTask.objects.get(name="dj-due").total_run_count == 1


def test_a_saved_row_fires_on_its_new_schedule_without_reading_the_table_again(make_app: Any) -> None:
    from celery_safe_time import signals
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler

    sent: list[tuple[str, float]] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        sent.append((kw["entry"], time.time()))

    hourly = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.HOURS)
    now = dt.datetime.now(UTC)
    PeriodicTask.objects.bulk_create(
        [PeriodicTask(name=f"dj-idle-{i}", task="tests.record", interval=hourly, last_run_at=now) for i in range(50)]
    )
    PeriodicTask.objects.create(name="dj-edited", task="tests.record", interval=hourly, last_run_at=now)
    app = make_app(safe_time_beat_lease=3)
    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    try:
        sched = SafeDatabaseScheduler(app=app, max_interval=1)
        try:
            wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
            _ticks(sched, 1.0)
            assert sched.index_reads == 1
            assert sent == []
            # an edit as the admin's change form makes it: the row saved with a new schedule
            row = PeriodicTask.objects.get(name="dj-edited")
            row.interval = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
            row.save()
            saved_at = time.time()
            _ticks(sched, 3.0)
            reads = sched.index_reads
        finally:
            sched.close()
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
    fired = [at for name, at in sent if name == "dj-edited"]
    assert fired
    assert fired[0] - saved_at <= 2.0
    assert len(fired) >= 2  # then on its 1 s grid
    assert {name for name, _ in sent} == {"dj-edited"}
    assert reads == 1  # picked up alone, the table not read again


def test_a_deleted_row_and_a_bulk_disable_stop_firing(make_app: Any) -> None:
    """Changes that no saved row reports (a delete, the admin's bulk actions) still reach the index."""
    from celery_safe_time import signals
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler

    sent: list[tuple[str, float]] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        sent.append((kw["entry"], time.time()))

    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    for name in ("dj-deleted", "dj-disabled", "dj-kept"):
        PeriodicTask.objects.create(name=name, task="tests.record", interval=every)
    app = make_app(safe_time_beat_lease=3)
    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    try:
        sched = SafeDatabaseScheduler(app=app, max_interval=1)
        try:
            wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
            _ticks(sched, 2.5)
            assert {name for name, _ in sent} == {"dj-deleted", "dj-disabled", "dj-kept"}
            PeriodicTask.objects.get(name="dj-deleted").delete()
            PeriodicTask.objects.filter(name="dj-disabled").update(enabled=False)
            PeriodicTasks.update_changed()  # what the admin's disable action does after its update
            changed_at = time.time()
            _ticks(sched, 3.0)
        finally:
            sched.close()
    finally:
        signals.beat_slot_dispatched.disconnect(on_sent)
    after = {name for name, at in sent if at > changed_at + 1.0}
    assert after == {"dj-kept"}
