"""Debounce: a burst of calls on a few keys, beside plain stored ``apply_async``, same run, same store.

``python -m benchmarks.debounce [--quick]`` prints a markdown table; ``run(quick)`` returns the numbers.

Per store (PostgreSQL, MariaDB): ``CALLS`` calls from ``THREADS`` threads on ``KEYS`` keys, timed as
calls/s: plain stored calls (``countdown`` past the threshold: one new row each) and debounced calls
(``debounce=`` on ``KEYS`` keys: a new row for the first call of a key, the pending row moved and its
arguments replaced for every other). Then the debounced rows come due and the real sweep (in this
process) publishes them: the messages it publishes are the runs. Rows touched: rows inserted and rows
updated in place, from the calls' own answers, and the rows the table holds afterwards.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore, delays
from celery_safe_time.delays.sweep import sweep
from tests.apps.delays_tasks import define_tasks
from tests.helpers import services
from tests.helpers.processes import wait_for

#: Calls per kind (full / quick: a smoke run, each key still merges 25 calls), keys they fall on, caller threads.
CALLS = {False: 10_000, True: 500}
KEYS = {False: 100, True: 20}
THREADS = 2
#: Alternating rounds of plain and debounced calls.
ROUNDS = 5
#: The debounce period: as short as the sweep interval allows, so the runs come due within the run.
PERIOD = 5.0
MAX_WAIT = 300.0


def _app(store_url: str, redis_url: str) -> Celery:
    app = Celery("bench-debounce", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        result_backend=None,
        safe_time_store_url=store_url,
        safe_time_store_namespace="bench",
        safe_time_sweep_interval=PERIOD,
        task_ignore_result=True,
        timezone="UTC",
    )
    install(app)
    define_tasks(app)
    return app


def _timed_calls(numbers: range, call: Callable[[int], Any]) -> tuple[float, list[Any]]:
    """``call(n)`` for each of ``numbers``, split over ``THREADS`` threads; (calls per second, the results)."""
    results: list[Any] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        mine = []
        try:
            mine.extend(call(n) for n in numbers[offset::THREADS])
        except BaseException as exc:  # reported below
            errors.append(exc)
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return len(numbers) / elapsed, results


def _rows(store: SQLAlchemyStore) -> int:
    with store.engine.begin() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {C.DELAY_TABLE}")).scalar_one())


def _empty(store: SQLAlchemyStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {C.DELAY_TABLE}"))


def bench_store(kind: str, store_url: str, redis_url: str, quick: bool) -> dict[str, Any]:
    calls, keys = CALLS[quick], KEYS[quick]
    app = _app(store_url, redis_url)
    task = app.tasks["tests.delays.add"]
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    store.ensure_schema()
    _empty(store)
    client = redis.Redis.from_url(redis_url)
    client.delete("celery")
    # Warm the pool and the statements: the first call of each kind is not what is compared.
    task.apply_async((0, 0), countdown=3600)
    task.apply_async((0, 0), debounce=3600, debounce_key="warm:{x}")
    _empty(store)

    last: dict[int, int] = {}

    def plain(n: int) -> Any:
        return task.apply_async((n % keys, n), countdown=3600)

    def debounced(n: int) -> Any:
        key = n % keys
        last[key] = max(last.get(key, -1), n)
        return task.apply_async((key, n), debounce=PERIOD, debounce_key="site:{x}", debounce_max_wait=MAX_WAIT)

    # The two kinds in alternating rounds, so a change of the host's load hits both alike. No sweep
    # runs meanwhile: a debounced row that comes due between rounds stays pending and keeps merging.
    seconds = {"plain": 0.0, "debounce": 0.0}
    results: list[Any] = []
    plain_ids: set[str] = set()
    per_round = calls // ROUNDS
    for r in range(ROUNDS):
        numbers = range(r * per_round, (r + 1) * per_round)
        rate, done = _timed_calls(numbers, plain)
        seconds["plain"] += len(numbers) / rate
        plain_ids.update(x.id for x in done)
        rate, done = _timed_calls(numbers, debounced)
        seconds["debounce"] += len(numbers) / rate
        results += done
    plain_rate = per_round * ROUNDS / seconds["plain"]
    debounce_rate = per_round * ROUNDS / seconds["debounce"]
    calls = per_round * ROUNDS
    plain_rows = len(plain_ids)
    inserted = len({r.id for r in results})
    table_rows = _rows(store) - plain_rows
    burst_seconds = seconds["debounce"]
    with store.engine.begin() as conn:  # the plain rows (due in an hour) are not what the sweep is run for
        conn.execute(sa.delete(delays).where(delays.c.id.in_(sorted(plain_ids))))

    # The rows come due PERIOD after their last call; the sweep publishes each one: one run per key.
    wait_for(
        lambda: store.pending_ahead(store.now(), keys + 1)[0] == table_rows or None,
        PERIOD + 30,
        message="the debounced rows to come due",
    )
    for _ in range(10):
        sweep(app)
        if store.counts()[C.STATUS_PENDING] == 0:
            break
    runs = int(client.llen("celery"))
    client.delete("celery")
    store.close()
    client.close()
    return {
        "store": kind,
        "calls": calls,
        "keys": keys,
        "threads": THREADS,
        "plain_calls_per_s": round(plain_rate, 1),
        "plain_rows": plain_rows,
        "debounce_calls_per_s": round(debounce_rate, 1),
        "debounce_burst_s": round(burst_seconds, 2),
        "rows_inserted": inserted,
        "rows_updated_in_place": calls - inserted,
        "table_rows_after": table_rows,
        "runs": runs,
    }


def run(quick: bool = False) -> dict[str, Any]:
    claim = services.RedisDbClaim(services.resolve_redis_base())
    redis_url = claim.url
    redis.Redis.from_url(redis_url).flushdb()
    results: dict[str, Any] = {"quick": quick, "stores": []}
    try:
        pg = services.PostgresDatabase(services.resolve_postgres_admin_url())
        try:
            url = pg.url.replace("postgresql://", "postgresql+psycopg://", 1)
            results["stores"].append(bench_store("PostgreSQL", url, redis_url, quick))
        finally:
            pg.drop()
        try:
            my = services.MySQLDatabase(services.resolve_mysql_admin_url())
        except BaseException as exc:  # services.unavailable() raises pytest's skip outcome
            results["mariadb_missing"] = str(exc) or exc.__class__.__name__
        else:
            try:
                results["stores"].append(bench_store("MariaDB", my.url, redis_url, quick))
            finally:
                my.drop()
    finally:
        redis.Redis.from_url(redis_url).flushdb()
        claim.release()
    return results


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| store | calls (keys, threads) | plain stored calls/s | debounced calls/s | ratio | rows inserted "
        "| rows updated in place | table rows after (plain / debounced) | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result.get("stores", []):
        ratio = s["debounce_calls_per_s"] / s["plain_calls_per_s"] if s["plain_calls_per_s"] else 0.0
        rows.append(
            f"| {s['store']} | {s['calls']:,} ({s['keys']}, {s['threads']}) | {s['plain_calls_per_s']:,.0f} "
            f"| {s['debounce_calls_per_s']:,.0f} | {ratio:.2f}x | {s['rows_inserted']:,} "
            f"| {s['rows_updated_in_place']:,} | {s['plain_rows']:,} / {s['table_rows_after']:,} | {s['runs']:,} |"
        )
    if result.get("mariadb_missing"):
        rows.append(f"\nMariaDB not measured: {result['mariadb_missing']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(markdown(run(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
