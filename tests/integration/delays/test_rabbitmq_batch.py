"""The sweep's batched publish on RabbitMQ (issue 20): each batch's messages written at once, the
publisher confirms collected per batch, a row marked sent only after its confirm.

What send_task gives stays per message: the task's routes (a router function sees each row's
arguments), headers, priority, ``before/after_task_publish`` and the ``task-sent`` event. A channel
error or a closed connection mid-batch leaves every unconfirmed row pending for the next sweep.
Each test has a vhost of its own (``amqp_url``); only the test's own connections are closed.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from kombu import Connection, Exchange, Queue
from kombu.exceptions import OperationalError

from celery_safe_time import constants as C
from celery_safe_time import install
from celery_safe_time.delays import amqp_batch
from celery_safe_time.delays.backends.base import NewDelay
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.sweep import sweep
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import drain, fresh_sql_store, seconds

pytestmark = pytest.mark.integration

#: A topic exchange: Celery publishes to it by name (a direct one it turns into the default exchange).
ROUTED = Queue("routed", Exchange("routed-ex", type="topic"), routing_key="rk.routed")


@pytest.fixture
def store(postgres_url: str) -> Iterator[SQLAlchemyStore]:
    store = fresh_sql_store(postgres_url)
    yield store
    store.close()


def route_by_argument(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
    """Rows whose id ends in an even digit go to the routed queue; a ``nowhere-`` row to an exchange
    that does not exist (RabbitMQ closes the channel); the others to the default queue."""
    label = str(args[0]) if args else ""
    if label.startswith("nowhere-"):
        return {"exchange": "no-such-exchange", "routing_key": "nowhere", "exchange_type": "direct"}
    if label[-1:] in "02468":
        return {"queue": "routed"}
    return None


def app_for(make_app: Callable[..., Celery], amqp_url: str, redis_url: str, store_url: str, **conf: Any) -> Celery:
    settings: dict[str, Any] = {
        "broker_url": amqp_url,
        "result_backend": redis_url,
        "safe_time_redis_url": redis_url,
        "safe_time_store_url": store_url,
        "safe_time_delay_threshold": 1,
        "task_queues": [Queue("celery"), ROUTED],
        "task_routes": (route_by_argument,),
    }
    app = make_app("rabbit-batch", **{**settings, **conf})
    install(app)
    define_tasks(app)
    return app


def insert_rows(store: SQLAlchemyStore, ids: list[str], options: dict[str, Any] | None = None) -> None:
    now = store.now()
    rows = []
    for i, task_id in enumerate(ids):
        payload = json.dumps({"args": [task_id], "kwargs": {}, "options": options or {}}).encode()
        rows.append(
            NewDelay(
                task_id, "tests.delays.record", payload, "application/json", "utf-8", now - seconds(60 - i * 0.001)
            )
        )
    store.bulk_insert(rows)


def statuses(store: SQLAlchemyStore, ids: list[str]) -> dict[str, str]:
    return {task_id: store.get(task_id).status for task_id in ids}  # type: ignore[union-attr]


def declare_queues(url: str) -> None:
    with Connection(url) as conn:
        for queue in (Queue("celery"), ROUTED):
            queue(conn.default_channel).declare()


def test_a_batched_sweep_delivers_every_row_once_with_its_route_headers_and_priority(
    make_app: Callable[..., Celery], amqp_url: str, redis_url: str, postgres_url: str, store: SQLAlchemyStore
) -> None:
    app = app_for(make_app, amqp_url, redis_url, postgres_url)
    ids = [f"row-{i:03d}" for i in range(230)]
    insert_rows(store, ids, {"priority": 7, "headers": {"x-tenant": "acme"}})
    stats = sweep(app, batch=100)  # three batches, the last one partial
    assert (stats.sent, stats.batches, stats.unconfirmed, stats.failed) == (230, 3, 0, 0)
    assert set(statuses(store, ids).values()) == {C.STATUS_SENT}
    routed = drain(amqp_url, ROUTED)
    default = drain(amqp_url, "celery")
    by_id = {m.headers["id"]: m for m in routed + default}
    assert len(routed) + len(default) == len(by_id) == 230  # every row once
    assert {m.headers["id"] for m in routed} == {i for i in ids if i[-1] in "02468"}
    for message in routed:
        assert message.delivery_info["exchange"] == "routed-ex"
        assert message.delivery_info["routing_key"] == "rk.routed"
    for message in default:
        assert message.delivery_info["routing_key"] == "celery"
    for task_id, message in by_id.items():
        headers = message.headers
        assert headers["task"] == "tests.delays.record"
        assert headers["x-tenant"] == "acme"
        assert headers[C.HEADER_STORED]
        assert headers[C.HEADER_DELIVERY]
        assert headers["eta"]
        assert headers["argsrepr"] == repr([task_id])
        assert message.properties["priority"] == 7
        assert message.properties["delivery_mode"] == 2
        assert message.properties["correlation_id"] == task_id
        assert message.content_type == "application/json"
        args, kwargs, _embed = message.decode()
        assert (args, kwargs) == ([task_id], {})


def test_publish_signals_and_the_task_sent_event_fire_once_per_row(
    make_app: Callable[..., Celery], amqp_url: str, redis_url: str, postgres_url: str, store: SQLAlchemyStore
) -> None:
    """What monitoring reads (OpenTelemetry's Celery instrumentation: the publish signals; Flower:
    the ``task-sent`` event with ``task_send_sent_event``) sees each row, with its routing."""
    app = app_for(make_app, amqp_url, redis_url, postgres_url, task_send_sent_event=True)
    events = Queue("sent-events", Exchange("celeryev", type="topic"), routing_key="task.sent")
    with Connection(amqp_url) as conn:
        events(conn.default_channel).declare()
    ids = [f"sig-{i:03d}" for i in range(120)]
    insert_rows(store, ids)
    before: list[tuple[str, str, Any]] = []
    after: list[str] = []

    def on_before(
        sender: Any = None, headers: Any = None, routing_key: Any = None, exchange: Any = None, **_: Any
    ) -> None:
        before.append((headers["id"], routing_key, exchange))

    def on_after(sender: Any = None, headers: Any = None, **_: Any) -> None:
        after.append(headers["id"])

    before_task_publish.connect(on_before, weak=False)
    after_task_publish.connect(on_after, weak=False)
    try:
        assert sweep(app, batch=50).sent == 120
    finally:
        before_task_publish.disconnect(on_before)
        after_task_publish.disconnect(on_after)
    assert sorted(b[0] for b in before) == sorted(after) == ids
    for task_id, routing_key, exchange in before:
        assert (routing_key, exchange) == (("rk.routed", "routed-ex") if task_id[-1] in "02468" else ("celery", ""))
    sent_events = [json.loads(m.body) for m in drain(amqp_url, events)]
    assert sorted(e["uuid"] for e in sent_events) == ids
    assert {e["queue"] for e in sent_events} == {"routed", "celery"}


def test_a_channel_error_mid_batch_leaves_every_unconfirmed_row_pending_and_nothing_is_lost(
    make_app: Callable[..., Celery], amqp_url: str, redis_url: str, postgres_url: str, store: SQLAlchemyStore
) -> None:
    """The 60th of 100 rows is routed to an exchange that does not exist: RabbitMQ closes the channel
    (404) and drops what came after on it. The sweep fails; rows confirmed before the error are sent,
    every other row is pending. Once the route is fixed, the next sweep publishes them."""
    app = app_for(make_app, amqp_url, redis_url, postgres_url)
    declare_queues(amqp_url)  # so the rows before the error are routed whatever was declared
    ids = [f"row-{i:03d}" for i in range(59)] + ["nowhere-059"] + [f"row-{i:03d}" for i in range(60, 100)]
    insert_rows(store, ids)
    with pytest.raises(OperationalError, match=r"NOT_FOUND|no-such-exchange|404"):
        sweep(app, batch=100)
    after_error = statuses(store, ids)
    assert set(after_error.values()) <= {C.STATUS_SENT, C.STATUS_PENDING}, after_error
    assert after_error["nowhere-059"] == C.STATUS_PENDING
    assert all(after_error[i] == C.STATUS_PENDING for i in ids[60:])  # dropped after the error: not confirmed
    sent = {i for i, s in after_error.items() if s == C.STATUS_SENT}
    first = {m.headers["id"] for m in drain(amqp_url, ROUTED) + drain(amqp_url, "celery")}
    assert sent <= first, "a row was marked sent without its message in a queue"
    assert not first & set(ids[60:])

    app.conf.task_routes = ({"tests.delays.record": {"queue": "celery"}},)  # the fix: no more missing exchange
    app.amqp.flush_routes()
    del app.amqp.router  # the cached Router holds the old routes
    stats = sweep(app, batch=100)
    assert stats.sent == len(ids) - len(sent)
    assert set(statuses(store, ids).values()) == {C.STATUS_SENT}
    second = [m.headers["id"] for m in drain(amqp_url, "celery")]
    assert len(second) == len(set(second))
    assert first | set(second) == set(ids)  # nothing lost
    print(f"channel error at row 60: {len(sent)} confirmed and sent, {len(ids) - len(sent)} published again")


def _close_my_connections(vhost: str) -> int:
    """Close the RabbitMQ connections of ``vhost`` (this test's own) with ``rabbitmqctl``."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "vhost"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    pids = [line.split("\t")[0] for line in out.splitlines() if line.split("\t")[-1:] == [vhost]]
    for pid in pids:
        subprocess.run(["rabbitmqctl", "-q", "close_connection", pid, "test: closed mid-batch"], timeout=60, check=True)
    return len(pids)


def test_a_connection_closed_by_the_broker_mid_batch_loses_nothing_and_the_rows_come_again(
    make_app: Callable[..., Celery], amqp_url: str, redis_url: str, postgres_url: str, store: SQLAlchemyStore
) -> None:
    """RabbitMQ closes the sweeper's connection (``rabbitmqctl close_connection``, this vhost's only)
    while the third batch of 50 is being built. The first two batches were confirmed and are sent;
    every row of the third and fourth is pending; the next sweep publishes all of them."""
    app = app_for(make_app, amqp_url, redis_url, postgres_url, task_routes=None)
    vhost = amqp_url.rsplit("/", 1)[1]
    declare_queues(amqp_url)
    ids = [f"row-{i:03d}" for i in range(200)]
    insert_rows(store, ids)
    seen = [0]
    closed = [0]

    def close_at_120(headers: Any = None, **_: Any) -> None:
        if headers and headers.get(C.HEADER_STORED):
            seen[0] += 1
            if seen[0] == 120:
                closed[0] = _close_my_connections(vhost)

    before_task_publish.connect(close_at_120, weak=False)
    try:
        with pytest.raises(OperationalError):
            sweep(app, batch=50)
    finally:
        before_task_publish.disconnect(close_at_120)
    assert closed[0] >= 1
    after_close = statuses(store, ids)
    sent = {i for i, s in after_close.items() if s == C.STATUS_SENT}
    assert sent == set(ids[:100])  # two confirmed batches; the third was still buffered at the close
    assert set(after_close.values()) == {C.STATUS_SENT, C.STATUS_PENDING}
    first = [m.headers["id"] for m in drain(amqp_url, "celery")]
    assert set(first) == sent

    stats = sweep(app, batch=50)
    assert stats.sent == 100
    assert set(statuses(store, ids).values()) == {C.STATUS_SENT}
    second = [m.headers["id"] for m in drain(amqp_url, "celery")]
    assert sorted(first + second) == ids  # every row once: the third batch never left the buffer


def test_nacked_publishes_go_back_to_pending_and_each_row_is_delivered_once(
    make_app: Callable[..., Celery], amqp_url: str, redis_url: str, postgres_url: str, store: SQLAlchemyStore
) -> None:
    """A queue that holds 10 messages and rejects more (``x-overflow: reject-publish``): RabbitMQ nacks
    every publish past the 10th. The sweep marks the 10 acked rows sent, hands the 20 nacked ones back
    to pending (``unconfirmed``, a warning, no error) and stops; each later sweep, once the queue was
    drained, sends the next 10. Every row reaches the queue exactly once."""
    bounded = Queue("celery", queue_arguments={"x-max-length": 10, "x-overflow": "reject-publish"})
    app = app_for(make_app, amqp_url, redis_url, postgres_url, task_queues=[bounded], task_routes=None)
    ids = [f"nack-{i:03d}" for i in range(30)]
    insert_rows(store, ids)
    delivered: list[str] = []
    for round_ in range(3):
        stats = sweep(app, batch=30)
        assert (stats.sent, stats.unconfirmed) == (10, 20 - 10 * round_), stats
        assert stats.sent + stats.unconfirmed == stats.claimed
        delivered += [m.headers["id"] for m in drain(amqp_url, bounded)]
        counts = list(statuses(store, ids).values())
        assert counts.count(C.STATUS_SENT) == 10 * (round_ + 1)
        assert counts.count(C.STATUS_PENDING) == 20 - 10 * round_
    assert sorted(delivered) == ids


def test_on_another_celery_release_each_row_goes_through_send_task_itself_still_batched(
    make_app: Callable[..., Celery],
    amqp_url: str,
    redis_url: str,
    postgres_url: str,
    store: SQLAlchemyStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BatchSender follows one Celery release's ``send_task``; on any other, rows take ``app.send_task``
    (same buffer, same confirms): same routing, every row once."""
    monkeypatch.setattr(amqp_batch, "MIRRORED_CELERY", (0, 0))
    app = app_for(make_app, amqp_url, redis_url, postgres_url)
    calls: list[str] = []
    send_task = app.send_task

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("task_id") or args[4])  # send_task(name, args, kwargs, countdown, eta, task_id)
        return send_task(name, *args, **kwargs)

    monkeypatch.setattr(app, "send_task", counting)
    ids = [f"old-{i:03d}" for i in range(40)]
    insert_rows(store, ids)
    assert sweep(app, batch=25).sent == 40
    assert sorted(calls) == ids
    routed = {m.headers["id"] for m in drain(amqp_url, ROUTED)}
    default = {m.headers["id"] for m in drain(amqp_url, "celery")}
    assert routed == {i for i in ids if i[-1] in "02468"}
    assert routed | default == set(ids)
    assert not routed & default
