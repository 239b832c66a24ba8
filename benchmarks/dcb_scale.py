"""``SafeDatabaseScheduler`` vs django-celery-beat's ``DatabaseScheduler`` at 10,000 and 100,000 rows.

The rows, seeded with ``bulk_create`` into a fresh PostgreSQL database: 10 every second (they fire
during the run), the rest daily, half as crontab rows at 09:00 in 8 timezones and half as 24 h
intervals last run within the past hour. Per size and scheduler, in the same run:

- first tick: from creating the scheduler to the end of its first tick (for ``SafeDatabaseScheduler``
  with the lease taken in between);
- tick p99: steady ticks (the per-second rows firing among them);
- change pickup: a daily row saved with a 1 s interval, as the admin's change form saves it, until
  the scheduler publishes it, ticking as ``celery beat`` does (sleeping what each tick returns);
- full reads: how many times ``SafeDatabaseScheduler`` read its whole index (``index_reads``): the
  saved row is picked up alone;
- duplicate alarms: ``beat_slot_duplicate`` signals of ``SafeDatabaseScheduler`` (one beat, so none
  is a real duplicate).

``python -m benchmarks.dcb_scale [--quick] [--sizes 10000,100000]`` prints the result JSON;
``benchmarks.run`` runs it as the ``dcb-scale`` section.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any

import redis

from benchmarks.beat import _app, _ms, _ticks
from tests.helpers import services

SIZES = (10_000, 100_000)
#: quick (make bench-quick, CI): a smoke run that every phase still runs end to end (no code path of
#: either scheduler depends on the row count)
SIZES_QUICK = (2_000,)
EVERY_SECOND = 10
ZONES = (
    "UTC",
    "Europe/London",
    "Europe/Berlin",
    "Asia/Kolkata",
    "Asia/Tokyo",
    "America/New_York",
    "America/Los_Angeles",
    "Australia/Sydney",
)
EDITED = "dcb-edited"
LABELS = ("SafeDatabaseScheduler", "DatabaseScheduler")


def _seed(upto: int, have: int) -> None:
    """Rows ``have`` .. ``upto`` - 1 (the per-second rows and the edited one are in the first batch)."""
    from django.utils import timezone
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    now = timezone.now()
    second, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    daily, _ = IntervalSchedule.objects.get_or_create(every=86400, period=IntervalSchedule.SECONDS)
    crons = [CrontabSchedule.objects.get_or_create(minute="0", hour="9", timezone=zone)[0] for zone in ZONES]
    rows = []
    for i in range(have, upto):
        if i < EVERY_SECOND:
            rows.append(PeriodicTask(name=f"dcb-second-{i}", task="bench.noop", interval=second, last_run_at=now))
        elif i == EVERY_SECOND:
            rows.append(PeriodicTask(name=EDITED, task="bench.noop", interval=daily, last_run_at=now))
        elif i % 2:
            rows.append(
                PeriodicTask(name=f"dcb-cron-{i}", task="bench.noop", crontab=crons[i % len(crons)], last_run_at=now)
            )
        else:
            ran = now - timedelta(seconds=i % 3600)
            rows.append(PeriodicTask(name=f"dcb-daily-{i}", task="bench.noop", interval=daily, last_run_at=ran))
    PeriodicTask.objects.bulk_create(rows, batch_size=5000)


def _reset_edited() -> None:
    from django.utils import timezone
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    daily = IntervalSchedule.objects.get(every=86400, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(name=EDITED).update(interval=daily, last_run_at=timezone.now())


def _measure(cls: type, redis_url: str, ticks: int, pickup_timeout: float) -> dict[str, Any]:
    from django.db import connection
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from celery_safe_time import signals

    alarms: list[str] = []

    def on_duplicate(sender: Any, **kw: Any) -> None:
        alarms.append(kw["reason"])

    signals.beat_slot_duplicate.connect(on_duplicate, weak=False)
    app = _app(redis_url, safe_time_beat_lease=6)
    start = time.perf_counter()
    sched = cls(app=app, max_interval=1)
    keeper = getattr(sched, "keeper", None)
    try:
        while keeper is not None and keeper.epoch is None:
            time.sleep(0.01)
        sched.tick()
        out: dict[str, Any] = {"first_tick_s": round(time.perf_counter() - start, 3)}
        out.update(_ms(_ticks(sched.tick, ticks, 0.02)))
        reads = getattr(sched, "index_reads", None)

        published: list[float] = []
        apply_entry = sched.apply_entry

        def watch(entry: Any, producer: Any = None) -> Any:
            if entry.name == EDITED and not published:
                published.append(time.perf_counter())
            return apply_entry(entry, producer=producer)

        sched.apply_entry = watch  # type: ignore[method-assign]
        row = PeriodicTask.objects.get(name=EDITED)
        row.interval = IntervalSchedule.objects.get(every=1, period=IntervalSchedule.SECONDS)
        saved = time.perf_counter()
        row.save()
        while not published and time.perf_counter() - saved < pickup_timeout:
            interval = sched.tick()
            if interval and interval > 0:
                time.sleep(min(float(interval), 1.0))
        out["change_pickup_s"] = round(published[0] - saved, 3) if published else None
        if reads is not None:
            out["full_reads_for_the_change"] = getattr(sched, "index_reads", 0) - reads
        if keeper is not None:  # one beat, one lease: any "already fired" is a false alarm
            out["duplicate_alarms"] = len(alarms)
        return out
    finally:
        signals.beat_slot_duplicate.disconnect(on_duplicate)
        sched.close()
        connection.close()


def run(quick: bool, sizes: tuple[int, ...] | None = None, schedulers: tuple[str, ...] = LABELS) -> dict[str, Any]:
    claim = services.RedisDbClaim(services.resolve_redis_base())
    redis_url = claim.url
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    os.environ["SAFE_TIME_TEST_DJANGO_DB_URL"] = db.url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
    results: dict[str, Any] = {"quick": quick, "sizes": {}}
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django_celery_beat.schedulers import DatabaseScheduler

        from celery_safe_time.contrib.django.schedulers import SafeDatabaseScheduler

        call_command("migrate", verbosity=0, interactive=False)
        have = 0
        for size in sizes or (SIZES_QUICK if quick else SIZES):
            began = time.perf_counter()
            _seed(size, have)
            have = size
            per: dict[str, Any] = {"seed_s": round(time.perf_counter() - began, 1)}
            ticks = 20 if quick else (300 if size <= 10_000 else 200)
            for label, cls in (
                ("SafeDatabaseScheduler", SafeDatabaseScheduler),
                ("DatabaseScheduler", DatabaseScheduler),
            ):
                redis.Redis.from_url(redis_url).flushdb()
                _reset_edited()
                per[label] = _measure(cls, redis_url, ticks, pickup_timeout=60.0 + size / 500)
            results["sizes"][str(size)] = per
    finally:
        redis.Redis.from_url(redis_url).flushdb()
        claim.release()
        from django.db import connections

        connections.close_all()
        db.drop()
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| rows | scheduler | first tick (s) | tick p50 / p99 (ms) | a saved row published after (s) "
        "| full reads for it | duplicate alarms |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size, per in results.get("sizes", {}).items():
        for label in LABELS:
            if label not in per:
                continue
            m = per[label]
            reads, alarms = (
                ("" if v is None else v) for v in (m.get("full_reads_for_the_change"), m.get("duplicate_alarms"))
            )
            lines.append(
                f"| {int(size):,} | {label} | {m.get('first_tick_s')} | {m.get('p50_ms')} / {m.get('p99_ms')} "
                f"| {m.get('change_pickup_s')} | {reads} | {alarms} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", help="comma-separated row counts (default: 10000,100000; quick: 10000)")
    parser.add_argument("--schedulers", default=",".join(LABELS), help="comma-separated, of: " + ", ".join(LABELS))
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else None
    results = run(args.quick, sizes, tuple(args.schedulers.split(",")))
    for per in results["sizes"].values():
        for m in per.values():
            if isinstance(m, dict):
                m.pop("samples_ms", None)
    print(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
