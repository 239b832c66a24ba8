"""``SafeDatabaseScheduler`` honours a row's overlap policy (``safe_time_overlap`` in its headers JSON,
which the django-celery-beat admin edits), with a real beat and a real prefork worker."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import redis
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from tests.helpers.processes import ProcessManager, wait_for
from tests.integration.beat.test_django import _start
from tests.integration.beat.test_overlap import _ended, _events, _max_running

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_row_reads_its_overlap_policy_from_its_headers(make_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler, SafeModelEntry

    app = make_app()
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    start = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)

    def row(name: str, headers: str) -> PeriodicTask:
        return PeriodicTask.objects.create(
            name=name, task="tests.record", interval=every, last_run_at=start, headers=headers
        )

    good = SafeModelEntry(row("good", '{"safe_time_overlap": "skip", "safe_time_overlap_ttl": 30, "x": "1"}'), app=app)
    assert good.overlap_options == {"safe_time_overlap": "skip", "safe_time_overlap_ttl": 30.0}
    assert good.options["headers"] == {"x": "1", "periodic_task_name": "good"}
    bad = row("bad", '{"safe_time_overlap": "sometimes"}')
    scheduler = type("S", (), {"Entry": SafeModelEntry, "app": app, "enabled_models": lambda self: [bad, good.model]})()
    with caplog.at_level("ERROR"):
        schedule = SafeDatabaseScheduler.all_as_schedule(scheduler)  # type: ignore[arg-type]
    assert set(schedule) == {"good"}
    assert "entry 'bad' is disabled: safe_time_overlap must be one of allow, skip, buffer_one" in caplog.text


def test_a_skip_row_runs_one_at_a_time(processes: ProcessManager, redis_client: redis.Redis) -> None:
    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name="dj-skip",
        task="tests.overlap_run",
        interval=every,
        args='["dj-skip", 2.5]',
        headers='{"safe_time_overlap": "skip", "safe_time_overlap_ttl": 6}',
    )
    (beat,) = _start(processes, 1)
    wait_for(lambda: _ended(_events(redis_client, "dj-skip")) >= 3, 60, message="three runs")
    beat.terminate()
    events = _events(redis_client, "dj-skip")
    assert _max_running(events) == 1, events
    starts = sum(e["event"] == "start" for e in events)
    dropped = beat.log().count("dropped (overlap skip")
    assert dropped >= starts - 1, (dropped, starts)


def test_an_invalid_row_is_logged_once_per_change_not_per_reload(
    make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 40, trap 4: the leader logged the same ERROR five times within 0.5 s (one per reload).
    from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler, SafeModelEntry, invalid_rows

    app = make_app()
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    bad = PeriodicTask.objects.create(
        name="typo", task="tests.record", interval=every, headers='{"safe_time_overlap": "sikp"}'
    )
    scheduler = type("S", (), {"Entry": SafeModelEntry, "app": app, "enabled_models": lambda self: [bad]})()
    # check and beat list name it without logging, and without hiding it from the leader's log
    assert list(invalid_rows(app)) == ["typo"]

    def reloads(count: int) -> int:
        caplog.clear()
        with caplog.at_level("ERROR"):
            for _ in range(count):
                SafeDatabaseScheduler.all_as_schedule(scheduler)  # type: ignore[arg-type]
        return sum("entry 'typo' is disabled" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")

    assert reloads(5) == 1
    bad.headers = '{"safe_time_overlap": "bufer_one"}'  # another mistake: a change, logged
    assert reloads(5) == 1
    bad.headers = '{"safe_time_overlap": "skip"}'  # fixed
    assert reloads(1) == 0
    assert set(SafeDatabaseScheduler.all_as_schedule(scheduler)) == {"typo"}  # type: ignore[arg-type]
    bad.headers = '{"safe_time_overlap": "sikp"}'  # broken again: logged again
    assert reloads(3) == 1
