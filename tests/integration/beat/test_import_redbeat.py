"""``celery safe-time beat import-redbeat`` against entries written by the real celery-redbeat package."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_interval

from celery_safe_time import get_entry
from celery_safe_time.beat.scheduler import SafeScheduler
from tests.helpers.beat import BEAT_APP, beat_env
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.services import RedisServer

redbeat = pytest.importorskip("redbeat")
redbeat_schedules = pytest.importorskip("redbeat.schedules")

pytestmark = pytest.mark.integration

UTC = timezone.utc


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _write_redbeat_entries(redis_url: str, last: datetime) -> None:
    app = Celery("redbeat-writer", set_as_current=False)
    app.conf.update(broker_url=redis_url, redbeat_redis_url=redis_url, timezone="UTC")
    entry = redbeat.RedBeatSchedulerEntry
    hourly = entry("hourly", "tests.record", celery_interval(timedelta(seconds=3600)), args=["hourly"], app=app)
    hourly.save()
    hourly.reschedule(last_run_at=last)
    entry(
        "report-9am", "tests.record", celery_crontab(minute="0", hour="9", day_of_week="1-5"), args=["r"],
        kwargs={"sleep": 0}, options={"queue": "celery"}, app=app,
    ).save()  # fmt: skip
    rule = redbeat_schedules.rrule("DAILY", dtstart=datetime(2026, 1, 1, 6, 0, tzinfo=UTC), byhour=6, app=app)
    entry("daily-rrule", "tests.record", rule, app=app).save()
    entry("off", "tests.record", celery_interval(timedelta(seconds=60)), enabled=False, app=app).save()
    entry("unknown", "no.such.task", celery_interval(timedelta(seconds=60)), app=app).save()


def test_import_redbeat_copies_entries_and_their_last_run(
    processes: ProcessManager,
    redis_url: str,
    redis_client: redis.Redis,
    make_app: Callable[..., Celery],
    tmp_path: Path,
) -> None:
    last = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    _write_redbeat_entries(redis_url, last)
    redbeat_keys = sorted(redis_client.keys("redbeat:*"))

    dry = processes.cli(BEAT_APP, "safe-time", "beat", "import-redbeat", "--dry-run", env=beat_env({}))
    assert "5 would import" in dry.stdout, dry.stdout + dry.stderr
    assert redis_client.keys("safe_time:*") == []

    done = processes.cli(BEAT_APP, "safe-time", "beat", "import-redbeat", "--json", env=beat_env({}))
    assert done.returncode == 1, done.stderr  # the unknown task is reported
    result = json.loads(done.stdout)
    assert sorted(result["imported"]) == ["daily-rrule", "hourly", "off", "report-9am"]
    assert "unknown task 'no.such.task'" in result["failed"]["unknown"]
    assert sorted(redis_client.keys("redbeat:*")) == redbeat_keys  # redbeat's keys are left alone

    again = processes.cli(BEAT_APP, "safe-time", "beat", "import-redbeat", "--json", env=beat_env({}))
    assert sorted(json.loads(again.stdout)["unchanged"]) == ["daily-rrule", "hourly", "off", "report-9am"]

    app = make_app(safe_time_beat_lease=3)
    app.task(name="tests.record", shared=False)(_noop)
    report = get_entry("report-9am", app=app)
    assert report is not None
    assert (report.task, report.args, report.kwargs, report.options) == (
        "tests.record",
        ("r",),
        {"sleep": 0},
        {"queue": "celery"},
    )
    off = get_entry("off", app=app)
    assert off is not None
    assert not off.enabled
    rule = get_entry("daily-rrule", app=app)
    assert rule is not None
    assert rule.schedule.next_ts(datetime(2026, 3, 1, 7, 0, tzinfo=UTC).timestamp()) == (
        datetime(2026, 3, 2, 6, 0, tzinfo=UTC).timestamp()
    )

    # a leader continues the hourly entry after redbeat's last run: its next slot is last + 1 h
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    try:
        wait_for(lambda: sched.keeper.is_leader, 10)
        sched.tick()
    finally:
        sched.close()
    hourly = get_entry("hourly", app=app)
    assert hourly is not None
    assert hourly.last_fired == last
    assert hourly.next_fire == last + timedelta(hours=1)


def test_import_reads_redbeats_entries_where_redbeat_keeps_them_not_from_safe_time_redis_url(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    # redbeat on a Redis of its own (redbeat_redis_url); the app's broker and safe_time's keys on another.
    last = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    _write_redbeat_entries(redis_server.url, last)
    redbeat_client = redis.Redis.from_url(redis_server.url)
    redbeat_keys = sorted(redbeat_client.keys("*"))

    done = processes.cli(
        BEAT_APP, "safe-time", "beat", "import-redbeat", env=beat_env({}, redbeat_redis_url=redis_server.url)
    )
    assert done.returncode == 1, done.stdout + done.stderr  # the entry of an unknown task is reported
    assert f"4 imported, 0 unchanged, 0 skipped, 1 failed (from redbeat: at {redis_server.url})" in done.stdout
    assert redis_client.keys("redbeat*") == []
    assert redis_client.keys("safe_time:*") != []  # the runtime entries live where this app keeps them
    assert sorted(redbeat_client.keys("*")) == redbeat_keys

    # --redis-url names redbeat's Redis when the app's settings do not.
    again = processes.cli(
        BEAT_APP, "safe-time", "beat", "import-redbeat", "--json", "--redis-url", redis_server.url, env=beat_env({})
    )
    assert sorted(json.loads(again.stdout)["unchanged"]) == ["daily-rrule", "hourly", "off", "report-9am"]


def test_import_with_no_redbeat_entries_says_where_it_looked_and_exits_1(
    processes: ProcessManager, redis_url: str, redis_server: RedisServer
) -> None:
    # Entries under another prefix than the one asked for: nothing is found there.
    _write_redbeat_entries(redis_server.url, datetime.now(UTC) - timedelta(minutes=10))
    empty = processes.cli(
        BEAT_APP, "safe-time", "beat", "import-redbeat", "--prefix", "other",
        env=beat_env({}, redbeat_redis_url=redis_server.url),
    )  # fmt: skip
    assert empty.returncode == 1, empty.stdout + empty.stderr
    assert f"no redbeat entries under other: at {redis_server.url}" in empty.stderr
    # Nothing found at the broker (the redbeat default when redbeat_redis_url is unset) either.
    unset = processes.cli(BEAT_APP, "safe-time", "beat", "import-redbeat", env=beat_env({}))
    assert unset.returncode == 1, unset.stdout + unset.stderr
    assert f"no redbeat entries under redbeat: at {redis_url}" in unset.stderr
