"""SafeTask.apply_many: many calls, one store transaction, the semantics of single calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import install, signals
from celery_safe_time.delays.backends import get_store
from celery_safe_time.exceptions import SerializationError, StoreError
from tests.apps.delays_tasks import define_tasks

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgresql"])
def app(request: pytest.FixtureRequest, make_app: Callable[..., Celery], sqlite_url: str) -> Celery:
    store_url = sqlite_url if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    app = make_app("many", safe_time_delay_threshold=60, safe_time_store_url=store_url, task_queues=None)
    install(app)
    define_tasks(app)
    from tests.helpers.delays import fresh_sql_store

    fresh_sql_store(store_url).close()
    return app


def _queued(app: Celery) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return [json.loads(raw) for raw in client.lrange("celery", 0, -1)]
    finally:
        client.close()


def test_apply_many_stores_long_delays_and_sends_short_ones(app: Celery) -> None:
    task = app.tasks["tests.delays.record"]
    stored: list[str] = []

    def on_stored(sender: Any = None, task_id: str = "", **_: Any) -> None:
        stored.append(task_id)

    signals.delay_stored.connect(on_stored, weak=False)
    try:
        results = task.apply_many(
            [
                (("a",), {}, {"countdown": 3600}),
                (("b",), None, {"countdown": 5}),  # short: the broker, as usual
                (("c",),),
                (("d",), {}, {"countdown": 7200, "task_id": "mine", "queue": "q-long"}),
            ]
        )
    finally:
        signals.delay_stored.disconnect(on_stored)
    assert len(results) == 4
    store = get_store(app)
    assert [store.get(r.id) is not None for r in results] == [True, False, False, True]
    assert results[3].id == "mine"
    assert stored == [results[0].id, "mine"]
    row = store.get("mine")
    assert row is not None
    assert json.loads(row.payload)["options"]["queue"] == "q-long"
    assert {m["headers"]["id"] for m in _queued(app)} == {results[1].id, results[2].id}


def test_idempotency_keys_behave_as_for_single_calls(app: Celery) -> None:
    task = app.tasks["tests.delays.record"]
    first = task.apply_async(("x",), countdown=3600, idempotency_key="k1")
    results = task.apply_many(
        [
            (("y",), {}, {"countdown": 3600, "idempotency_key": "k1"}),
            (("z",), {}, {"countdown": 3600, "idempotency_key": "k2"}),
            (("w",), {}, {"countdown": 3600, "idempotency_key": "k2"}),
            (("v",), {}, {"countdown": 1, "idempotency_key": "k3"}),  # short: key dropped, sent
        ]
    )
    assert results[0].id == first.id
    assert results[2].id == results[1].id
    assert get_store(app).counts()[C.STATUS_PENDING] == 2


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ((("ok",), {}, {"countdown": 3600, "task_id": "taken"}), StoreError),
        ((({1, 2},), {}, {"countdown": 3600}), SerializationError),  # a set: JSON refuses it
        ("not a call", TypeError),
        ((("ok",), "kwargs?", {}), TypeError),
    ],
)
def test_a_bad_item_fails_the_call_naming_it_and_stores_nothing(app: Celery, bad: Any, error: type) -> None:
    task = app.tasks["tests.delays.record"]
    task.apply_async(("x",), countdown=3600, task_id="taken")
    calls = [(("ok",), {}, {"countdown": 3600}), (("now",), {}, {}), bad, (("after",), {}, {"countdown": 7200})]
    with pytest.raises(error, match="apply_many item 2") as failed:
        task.apply_many(calls)
    assert failed.value.index == 2  # type: ignore[attr-defined]
    assert get_store(app).counts()[C.STATUS_PENDING] == 1  # only "taken"
    assert _queued(app) == []  # the short call of the batch was not sent either


def test_eager_mode_runs_every_call(make_app: Callable[..., Celery]) -> None:
    app = make_app("many-eager", task_always_eager=True, safe_time_delay_threshold=60)
    install(app)
    define_tasks(app)
    results = app.tasks["tests.delays.add"].apply_many([((1, 2),), ((3, 4), {}, {"countdown": 3600})])
    assert [r.get() for r in results] == [3, 7]
