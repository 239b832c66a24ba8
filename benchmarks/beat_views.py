"""The operator views at SaaS size: ``beat list``, its counts and ``status`` with 100,000 and 1,000,000
runtime entries (``--sizes``; quick: 10,000), on Redis and on PostgreSQL coordination.

Per size and backend, in the same run on the same stored entries (``beat_scale``'s: daily at 09:00
in their tenant's timezone, 10 every second; every 50th paused):

- before (the whole read every view did): ``list_entries`` + ``invalid_entries`` (what ``beat list``
  ran), and ``status``'s invalid-entry check (``invalid_entries``);
- now: the first page of ``beat list`` (1,000 entries; on Redis once with the name index cold, as
  after an upgrade, then warm), a page with a prefix, a page of ``--state paused``, the counts
  (``count_entries``) and ``describe_beat`` (``status``'s section).

``python -m benchmarks.beat_views [--quick] [--sizes 100000,1000000] [--backends redis,postgres]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.beat_scale import _app, _specs
from benchmarks.common import print_report
from tests.helpers import services

SIZES = (100_000, 1_000_000)
#: quick (make bench-quick, CI): a smoke run, still three pages and the whole read before
SIZES_QUICK = (3_000,)
BACKENDS = ("redis", "postgres")
#: the whole read (before) up to this size by default (``--baseline-max``): at 100,000 it already
#: takes about two minutes on the shared benchmark VM, and grows with the count
BASELINE_MAX = 100_000
PAGE = 1000


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return round(time.perf_counter() - started, 4), value


def _postgres_url() -> str:
    url = os.environ.get("SAFE_TIME_TEST_DATABASE_URL", services.DEFAULT_DATABASE_URL)
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def _drop_postgres(app: Any) -> None:
    import sqlalchemy as sa

    from celery_safe_time.config import get_config
    from celery_safe_time.coordination import coordination_engine

    config = get_config(app)
    with coordination_engine(config).begin() as conn:
        for table in ("entries", "changes", "state", "meta", "counts", "run_now", "audit", "history"):
            conn.execute(sa.text(f"DELETE FROM safe_time_beat_{table} WHERE ns = :ns"), {"ns": config.key_prefix})


def bench_one(redis_url: str, backend: str, n: int, baseline: bool) -> dict[str, Any]:
    from celery_safe_time import save_entries
    from celery_safe_time.beat.admin import describe_beat
    from celery_safe_time.beat.entries import list_entries
    from celery_safe_time.beat.entry_pages import count_entries, invalid_entries, page_entries

    prefix = f"views-{uuid.uuid4().hex[:8]}:"
    app = _app(redis_url)
    app.conf.safe_time_key_prefix = prefix
    if backend == "postgres":
        app.conf.safe_time_coordination_url = _postgres_url()
    specs = _specs(n)
    for i, spec in enumerate(specs):
        spec["enabled"] = i % 50 != 1
    out: dict[str, Any] = {"entries": n, "backend": backend, "load average": os.getloadavg()[0]}
    try:
        out["save s"], _ = _timed(lambda: save_entries(specs, app=app))
        specs.clear()
        # now
        out["first page, cold s"], page = _timed(lambda: page_entries(app=app, limit=PAGE))
        assert len(page.entries) == PAGE, len(page.entries)
        out["first page s"], _ = _timed(lambda: page_entries(app=app, limit=PAGE))
        out["next page s"], _ = _timed(lambda: page_entries(app=app, limit=PAGE, after=page.after))
        out["prefix page s"], _ = _timed(lambda: page_entries(app=app, limit=PAGE, prefix="tenant-99"))
        out["paused page s"], _ = _timed(lambda: page_entries(app=app, limit=100, state="paused"))
        out["counts s"], counts = _timed(lambda: count_entries(app))
        assert counts["runtime"] == n, counts
        out["status s"], _ = _timed(lambda: describe_beat(app))
        # before
        if baseline:
            out["before: list s"], listed = _timed(lambda: (list_entries(app=app), invalid_entries(app)))
            assert len(listed[0]) == n, len(listed[0])
            del listed
            out["before: status check s"], _ = _timed(lambda: invalid_entries(app))
    finally:
        if backend == "postgres":
            _drop_postgres(app)
        else:
            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(f"{prefix}*", count=10_000):
                client.delete(key)
    return out


def run(
    quick: bool,
    sizes: list[int] | None = None,
    backends: list[str] | None = None,
    baseline_max: int = BASELINE_MAX,
) -> dict[str, Any]:
    claim = services.RedisDbClaim(services.resolve_redis_base())
    results: dict[str, Any] = {"quick": quick, "page": PAGE}
    try:
        for n in sizes or (SIZES_QUICK if quick else SIZES):
            for backend in backends or BACKENDS:
                results[f"{backend} {n}"] = bench_one(claim.url, backend, n, baseline=n <= baseline_max)
    finally:
        redis.Redis.from_url(claim.url).flushdb()
        claim.release()
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"| backend | entries | beat list before (list + check, s) | first page of {results.get('page', PAGE):,} "
        "(cold index / warm, s) | next page (s) | prefix page (s) | --state paused page (s) | counts (s) "
        "| status before (check, s) | status now (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        if not isinstance(r, dict):
            continue
        before = r.get("before: list s")
        ratio = f" ({before / r['first page s']:,.0f}x)" if before and r.get("first page s") else ""
        lines.append(
            f"| {r['backend']} | {r['entries']:,} | {before if before is not None else '-'} "
            f"| {r['first page, cold s']} / {r['first page s']}{ratio} | {r['next page s']} | {r['prefix page s']} "
            f"| {r['paused page s']} | {r['counts s']} | {r.get('before: status check s', '-')} | {r['status s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default=None, help="Entry counts, comma-separated (default 100000,1000000).")
    parser.add_argument("--backends", default=None, help="redis,postgres (default both).")
    parser.add_argument(
        "--baseline-max", type=int, default=BASELINE_MAX, help="Measure the whole read up to this many entries."
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    backends = args.backends.split(",") if args.backends else None
    results = run(args.quick, sizes, backends, args.baseline_max)
    return print_report(markdown(results), results)


if __name__ == "__main__":
    sys.exit(main())
