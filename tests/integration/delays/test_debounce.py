"""Debounce end to end: real ``celery worker`` and beat subprocesses (the sweep), Redis, a SQL store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import cancel, install
from celery_safe_time import constants as C
from celery_safe_time.delays.backends import get_store
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import DELAYS_APP, fresh_sql_store, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration

KEYS = 10
CALLS = 1000
PERIOD = timedelta(seconds=5)
MAX_WAIT = timedelta(seconds=40)
#: The sweep publishes a due row within one interval (1 s here) and the worker starts it at once.
LATE = 3.0


@pytest.fixture(params=["postgresql", "mysql"])
def store_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("postgres_url" if request.param == "postgresql" else "mysql_url"))


def _cluster(processes: ProcessManager, store_url: str) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_store_url": store_url, "safe_time_sweep_interval": 1})}
    worker = processes.worker(DELAYS_APP, name="w", env=env)
    processes.beat(DELAYS_APP, name="beat", env=env, scheduler="celery.beat:PersistentScheduler")
    worker.wait_for_log(r"ready\.", timeout=90)


def _app(make_app: Callable[..., Celery], store_url: str) -> Celery:
    app = make_app("debounce-test", safe_time_store_url=store_url, safe_time_sweep_interval=1)
    install(app)
    define_tasks(app)
    return app


def test_a_thousand_debounced_calls_on_ten_keys_run_ten_times_with_the_last_arguments(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis, store_url: str
) -> None:
    fresh_sql_store(store_url).close()
    _cluster(processes, store_url)
    app = _app(make_app, store_url)
    add = app.tasks["tests.delays.add"]
    first_call: dict[int, float] = {}
    ids: dict[int, set[str]] = {key: set() for key in range(KEYS)}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def caller(offset: int) -> None:
        try:
            for n in range(offset, CALLS, 2):
                key = n % KEYS
                with lock:
                    first_call.setdefault(key, time.time())
                result = add.apply_async((key, n), debounce=PERIOD, debounce_key="site:{x}", debounce_max_wait=MAX_WAIT)
                with lock:
                    ids[key].add(result.id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(offset,)) for offset in range(2)]
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    burst = time.time() - started
    # Calls on one key come every few milliseconds, so no row comes due mid-burst; the cap must not either.
    assert burst < MAX_WAIT.total_seconds() - 10, f"the burst took {burst:.1f}s: too close to the max wait"
    # The last word on each key, from this thread after both others: the argument every run must carry.
    last = CALLS + 1
    for key in range(KEYS):
        result = add.apply_async((key, last), debounce=PERIOD, debounce_key="site:{x}", debounce_max_wait=MAX_WAIT)
        ids[key].add(result.id)
    last_call = time.time()
    assert all(len(found) == 1 for found in ids.values()), ids  # one row per key for the whole burst

    done = wait_for(lambda: len(runs(redis_client)) >= KEYS or None, 60, message="ten debounced runs")
    assert done
    # Nothing more comes: every row of the store is finished, none pending.
    store = get_store(app)
    wait_for(lambda: store.counts()[C.STATUS_FINISHED] == KEYS or None, 30, message="the ten rows recorded finished")
    recorded = runs(redis_client)
    assert sorted(r["label"] for r in recorded) == sorted(f"add:{key}+{last}" for key in range(KEYS))
    assert {r["task_id"] for r in recorded} == set().union(*ids.values())
    for run in recorded:
        key = int(run["label"].split(":")[1].split("+")[0])
        # Due a period after the last call, never later than the max wait after the first.
        assert run["started"] >= last_call + PERIOD.total_seconds() - 1.0
        assert run["started"] <= first_call[key] + MAX_WAIT.total_seconds() + LATE
        assert run["started"] <= last_call + PERIOD.total_seconds() + LATE
    assert store.counts()[C.STATUS_PENDING] == 0


def test_a_cancelled_debounced_row_never_runs(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis, store_url: str
) -> None:
    fresh_sql_store(store_url).close()
    _cluster(processes, store_url)
    app = _app(make_app, store_url)
    add = app.tasks["tests.delays.add"]
    # A longer period than the other tests': the row must still be pending after the CLI (a process of
    # its own, several seconds on a loaded machine) has listed it.
    options: dict[str, Any] = {
        "debounce": timedelta(seconds=15),
        "debounce_key": "site:{x}",
        "debounce_max_wait": MAX_WAIT,
    }
    doomed = add.apply_async((1, 1), **options)
    assert add.apply_async((1, 2), **options).id == doomed.id
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_store_url": store_url})}
    listed = processes.cli(DELAYS_APP, "safe-time", "delays", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    header, line = listed.stdout.splitlines()[:2]
    assert header.split()[-2:] == ["DEBOUNCE", "KEY"]
    assert line.split()[0] == doomed.id
    assert line.split()[-1] == "tests.delays.add:site:1"
    assert cancel(doomed.id, app=app)
    # A later burst on another key, due after the cancelled one was: once it has run, the other would have.
    witness = add.apply_async((2, 3), **options)
    wait_for(lambda: runs(redis_client) or None, 60, message="the witness run")
    assert [r["task_id"] for r in runs(redis_client)] == [witness.id]
    row = get_store(app).get(doomed.id)
    assert row is not None
    assert row.status == C.STATUS_CANCELLED
    # The key is free again: the next call starts a new burst.
    assert add.apply_async((1, 4), **options).id != doomed.id


def test_a_key_called_without_pause_runs_at_its_max_wait(
    processes: ProcessManager, make_app: Callable[..., Celery], redis_client: redis.Redis, store_url: str
) -> None:
    fresh_sql_store(store_url).close()
    _cluster(processes, store_url)
    app = _app(make_app, store_url)
    add = app.tasks["tests.delays.add"]
    options: dict[str, Any] = {"debounce": PERIOD, "debounce_key": "site:{x}", "debounce_max_wait": 8}
    first_call = time.time()
    first = add.apply_async((1, 0), **options)
    n = 0
    # A call every half second (the input pattern, not a wait): the quiet period never comes.
    while not runs(redis_client) and time.time() - first_call < 30:
        n += 1
        add.apply_async((1, n), **options)
        time.sleep(0.5)
    [run, *_] = runs(redis_client)
    assert run["task_id"] == first.id
    assert first_call + 8 - 1.0 <= run["started"] <= first_call + 8 + LATE
