"""SafeTask.apply_async and the sweep in this process, against real Redis and real stores."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery, chain
from celery.signals import before_task_publish

from celery_safe_time import cancel, install, reschedule, signals
from celery_safe_time import constants as C
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.exceptions import SerializationError, StoreError
from tests.apps.delays_tasks import define_tasks
from tests.helpers.delays import UTC, fresh_sql_store, new_delay, utcnow

pytestmark = pytest.mark.integration


class Published:
    """Messages this process publishes, captured from Celery's ``before_task_publish`` signal."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def __call__(self, sender: str | None = None, **kwargs: Any) -> None:
        self.messages.append({"task": sender, **kwargs})

    def by_id(self, task_id: str) -> dict[str, Any]:
        return next(m for m in self.messages if m["headers"]["id"] == task_id)


@pytest.fixture
def published() -> Iterator[Published]:
    capture = Published()
    before_task_publish.connect(capture, weak=False)
    yield capture
    before_task_publish.disconnect(capture)


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    app = make_app("calls", safe_time_delay_threshold=60, task_queues=None)
    install(app)
    define_tasks(app)
    return app


def tasks(app: Celery) -> dict[str, Any]:
    return {name.rsplit(".", 1)[1]: app.tasks[name] for name in app.tasks if name.startswith("tests.delays.")}


def test_long_countdown_stores_a_row_and_publishes_nothing(app: Celery, published: Published) -> None:
    stored: list[dict[str, Any]] = []

    def on_stored(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        stored.append(kwargs)

    signals.delay_stored.connect(on_stored, weak=False)
    try:
        before = get_store(app).now()
        result = tasks(app)["record"].apply_async(("hello",), countdown=7200)
    finally:
        signals.delay_stored.disconnect(on_stored)
    assert published.messages == []
    row = get_store(app).get(result.id)
    assert row is not None
    assert row.status == C.STATUS_PENDING
    assert row.task == "tests.delays.record"
    assert timedelta(seconds=7199) < row.due_at - before < timedelta(seconds=7205)
    assert stored == [{"task_id": result.id, "task_name": "tests.delays.record", "due_at": row.due_at}]
    body = json.loads(row.payload)
    assert body["args"] == ["hello"]


def _message_shape(message: dict[str, Any]) -> dict[str, Any]:
    headers = dict(message["headers"])
    # The attempt token is new on every publish; the delivery token is the stored row's own.
    for volatile in (
        "id",
        "root_id",
        "eta",
        "expires",
        "task",
        "argsrepr",
        "origin",
        C.HEADER_ATTEMPT,
        C.HEADER_DELIVERY,
    ):
        headers.pop(volatile, None)
    # Compare what goes on the wire: JSON turns tuples into lists and signatures into dicts.
    props = {k: v for k, v in message["properties"].items() if v is not None}
    props.pop("correlation_id", None)
    props.pop("reply_to", None)
    return {
        "exchange": message["exchange"],
        "routing_key": message["routing_key"],
        "headers": headers,
        "properties": props,
        "body": json.loads(json.dumps(message["body"])),
    }


def test_short_delay_and_immediate_calls_are_plain_celery(app: Celery, published: Published) -> None:
    t = tasks(app)
    link = t["add"].s(1)
    link_error = t["plain_record"].si("failed")
    options = {
        "queue": "q-short",
        "priority": 3,
        "headers": {"x_custom": "v"},
        "link": link,
        "link_error": link_error,
    }
    safe = t["record"].apply_async(("x",), countdown=5, **options)
    plain = t["plain_record"].apply_async(("x",), countdown=5, **options)
    safe_now = t["record"].apply_async(("y",), **options)
    plain_now = t["plain_record"].apply_async(("y",), **options)
    assert get_store(app).counts()[C.STATUS_PENDING] == 0
    assert _message_shape(published.by_id(safe.id)) == _message_shape(published.by_id(plain.id))
    assert _message_shape(published.by_id(safe_now.id)) == _message_shape(published.by_id(plain_now.id))
    assert published.by_id(safe.id)["routing_key"] == "q-short"
    assert published.by_id(safe.id)["properties"]["priority"] == 3
    assert published.by_id(safe.id)["headers"]["x_custom"] == "v"
    assert published.by_id(safe.id)["headers"]["eta"] is not None


def test_stored_call_is_published_by_the_sweep_with_the_same_message(app: Celery, published: Published) -> None:
    t = tasks(app)
    link = t["add"].s(1)
    link_error = t["plain_record"].si("failed")
    options = {"queue": "q-long", "priority": 7, "headers": {"x_custom": "v"}, "link": link, "link_error": link_error}
    safe = t["record"].apply_async(("x",), countdown=3600, **options)
    assert published.messages == []
    due = get_store(app).now() + timedelta(seconds=1)
    assert reschedule(safe.id, eta=due, app=app)
    plain = t["plain_record"].apply_async(("x",), eta=due, **options)
    stats = sweep(app)
    assert stats.sent == 1
    assert get_store(app).get(safe.id).status == C.STATUS_SENT  # type: ignore[union-attr]
    stored_msg = published.by_id(safe.id)
    assert stored_msg["headers"][C.HEADER_STORED] == due.isoformat()
    assert stored_msg["headers"]["eta"] == published.by_id(plain.id)["headers"]["eta"]
    shape = _message_shape(stored_msg)
    shape["headers"].pop(C.HEADER_STORED)
    expected = _message_shape(published.by_id(plain.id))
    # The sweep runs in no task here, so parent/root ids match; only the task name differs.
    assert shape == expected


def test_released_and_cancelled_signals(app: Celery, published: Published) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def on_released(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        seen.append(("released", kwargs))

    def on_cancelled(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        seen.append(("cancelled", kwargs))

    signals.delay_released.connect(on_released, weak=False)
    signals.delay_cancelled.connect(on_cancelled, weak=False)
    try:
        keep = tasks(app)["record"].apply_async(("k",), countdown=3600)
        drop = tasks(app)["record"].apply_async(("d",), countdown=3600)
        assert cancel(drop.id, app=app)
        due = get_store(app).now() - timedelta(seconds=1)
        assert reschedule(keep.id, eta=due, app=app)
        assert sweep(app).sent == 1
    finally:
        signals.delay_released.disconnect(on_released)
        signals.delay_cancelled.disconnect(on_cancelled)
    assert seen == [
        ("cancelled", {"task_id": drop.id}),
        ("released", {"task_id": keep.id, "task_name": "tests.delays.record", "due_at": due}),
    ]


def test_result_tracking_and_revoke_cancels_the_row(app: Celery) -> None:
    result = tasks(app)["record"].apply_async(("r",), countdown=3600)
    assert result.state == "PENDING"
    assert result.id == tasks(app)["record"].AsyncResult(result.id).id
    result.revoke()
    assert get_store(app).get(result.id).status == C.STATUS_CANCELLED  # type: ignore[union-attr]
    assert result.state == "REVOKED"
    assert not cancel(result.id, app=app)


def test_cancel_and_reschedule_api(app: Celery) -> None:
    store = get_store(app)
    a = tasks(app)["record"].apply_async(("a",), countdown=3600)
    b = tasks(app)["record"].apply_async(("b",), countdown=3600)
    assert cancel(a.id, app=app)
    assert not cancel(a.id, app=app)
    assert not reschedule(a.id, countdown=10, app=app)
    assert reschedule(b.id, countdown=7200, app=app)
    row = store.get(b.id)
    assert row is not None
    assert row.due_at - store.now() > timedelta(seconds=7100)
    naive = datetime(2030, 1, 2, 3, 4, 5)
    assert reschedule(b.id, eta=naive, app=app)
    assert store.get(b.id).due_at == naive.replace(tzinfo=UTC)  # type: ignore[union-attr]
    assert reschedule(b.id, eta="2030-01-02T04:04:05+01:00", app=app)
    assert store.get(b.id).due_at == naive.replace(tzinfo=UTC)  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        reschedule(b.id, app=app)
    assert not cancel("no-such-id", app=app)


@pytest.mark.parametrize("database_url", ["postgres_url", "mysql_url"])
def test_idempotency_key_1000_calls_over_10_keys(
    make_app: Callable[..., Celery], database_url: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(database_url)
    fresh_sql_store(url).close()
    app = make_app("idem", safe_time_store_url=url, safe_time_delay_threshold=60)
    define_tasks(app)
    record = app.tasks["tests.delays.record"]

    def call(i: int) -> tuple[str, str]:
        key = f"key-{i % 10}"
        return key, record.apply_async((str(i),), countdown=3600, idempotency_key=key).id

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(1000)))
    store = get_store(app)
    assert store.counts()[C.STATUS_PENDING] == 10
    first: dict[str, str] = {}
    for key, task_id in results:
        first.setdefault(key, task_id)
        assert first[key] == task_id
    rows = store.list(status=C.STATUS_PENDING)
    assert {r.idempotency_key for r in rows} == {f"caller:tests.delays.record:key-{i}" for i in range(10)}
    assert {r.id for r in rows} == set(first.values())


@pytest.mark.parametrize("database_url", ["postgres_url", "mysql_url"])
def test_a_caller_key_matches_its_own_task_only(
    make_app: Callable[..., Celery], database_url: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(database_url)
    fresh_sql_store(url).close()
    app = make_app("idem-task", safe_time_store_url=url, safe_time_delay_threshold=60)
    define_tasks(app)
    record, add = app.tasks["tests.delays.record"], app.tasks["tests.delays.add"]
    first = record.apply_async(("a",), countdown=3600, idempotency_key="order-1")
    other = add.apply_async((1, 2), countdown=3600, idempotency_key="order-1")
    assert other.id != first.id  # same key, another task: a row of its own
    assert record.apply_async(("b",), countdown=3600, idempotency_key="order-1").id == first.id
    [many] = add.apply_many([((3, 4), {}, {"countdown": 3600, "idempotency_key": "order-1"})])
    assert many.id == other.id
    store = get_store(app)
    rows = {r.id: r for r in store.list(status=C.STATUS_PENDING)}
    assert set(rows) == {first.id, other.id}
    assert rows[first.id].idempotency_key == "caller:tests.delays.record:order-1"
    assert json.loads(rows[other.id].payload)["args"] == [1, 2]  # never replaced by the other task's call
    with pytest.raises(ValueError, match="idempotency_key"):
        add.apply_async((1, 2), countdown=3600, idempotency_key="caller:tests.delays.record:order-1")


# --- bad input ------------------------------------------------------------------


def test_unserializable_args_raise_at_call_site_and_store_nothing(app: Celery, published: Published) -> None:
    with pytest.raises(SerializationError):
        tasks(app)["record"].apply_async((object(),), countdown=3600)
    assert get_store(app).counts()[C.STATUS_PENDING] == 0
    assert published.messages == []


def test_naive_eta_is_utc_and_past_eta_sends_now(app: Celery, published: Published) -> None:
    naive = datetime.now(UTC).replace(tzinfo=None, microsecond=0) + timedelta(hours=2)
    result = tasks(app)["record"].apply_async(("n",), eta=naive)
    assert get_store(app).get(result.id).due_at == naive.replace(tzinfo=UTC)  # type: ignore[union-attr]
    past = tasks(app)["record"].apply_async(("p",), eta=utcnow() - timedelta(hours=1))
    assert get_store(app).get(past.id) is None
    assert published.by_id(past.id)["headers"]["eta"] is not None


def test_pickle_refused_unless_allowed(make_app: Callable[..., Celery]) -> None:
    app = make_app("pickles", safe_time_delay_threshold=60, accept_content=["json", "pickle"])
    define_tasks(app)
    record = app.tasks["tests.delays.record"]
    with pytest.raises(SerializationError, match="safe_time_allow_pickle"):
        record.apply_async(("p",), countdown=3600, serializer="pickle")
    assert get_store(app).counts()[C.STATUS_PENDING] == 0
    allowed = make_app("pickles2", safe_time_delay_threshold=60, safe_time_allow_pickle=True)
    define_tasks(allowed)
    result = allowed.tasks["tests.delays.record"].apply_async(("p",), countdown=3600, serializer="pickle")
    row = get_store(allowed).get(result.id)
    assert row is not None
    assert row.content_type == "application/x-python-serialize"


def test_store_down_raises_store_error_and_never_sends(make_app: Callable[..., Celery], published: Published) -> None:
    app = make_app("down", safe_time_delay_threshold=60, safe_time_store_url="postgresql://nobody:s3cret@127.0.0.1:1/x")
    define_tasks(app)
    with pytest.raises(StoreError) as info:
        app.tasks["tests.delays.record"].apply_async(("d",), countdown=3600)
    assert "s3cret" not in str(info.value)
    assert published.messages == []


def test_unknown_task_and_corrupt_payload_fail_and_the_sweep_goes_on(
    app: Celery, published: Published, redis_client: redis.Redis
) -> None:
    store = get_store(app)
    failed: list[dict[str, Any]] = []

    def on_failed(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        failed.append(kwargs)

    now = store.now() - timedelta(seconds=1)
    store.insert(new_delay("gone", now, task="tests.delays.removed_in_deploy"))
    store.insert(new_delay("corrupt", now, payload=b"{not json"))
    store.insert(new_delay("not-a-call", now, payload=b"[1, 2]"))
    store.insert(new_delay("good", now))
    signals.delay_failed.connect(on_failed, weak=False)
    try:
        stats = sweep(app)
    finally:
        signals.delay_failed.disconnect(on_failed)
    assert stats.sent == 1
    assert stats.failed == 3
    statuses = {i: store.get(i) for i in ("gone", "corrupt", "not-a-call", "good")}
    assert statuses["good"].status == C.STATUS_SENT  # type: ignore[union-attr]
    for name in ("gone", "corrupt", "not-a-call"):
        row = statuses[name]
        assert row is not None
        assert row.status == C.STATUS_FAILED
        assert row.last_error
    assert "unknown task" in statuses["gone"].last_error  # type: ignore[union-attr,operator]
    assert {f["task_id"] for f in failed} == {"gone", "corrupt", "not-a-call"}
    assert [m["headers"]["id"] for m in published.messages] == ["good"]


def test_relative_expires_becomes_absolute_and_expired_rows_are_not_sent(app: Celery, published: Published) -> None:
    store = get_store(app)
    relative = tasks(app)["record"].apply_async(("e",), countdown=3600, expires=1800)
    row = store.get(relative.id)
    assert row is not None
    assert row.expires_at is not None
    assert timedelta(seconds=1790) < row.expires_at - row.created_at < timedelta(seconds=1810)
    soon = tasks(app)["record"].apply_async(("s",), countdown=3600, expires=utcnow() + timedelta(seconds=1))
    live = tasks(app)["record"].apply_async(("l",), countdown=3600, expires=utcnow() + timedelta(hours=3))
    for task_id in (soon.id, live.id):
        assert store.reschedule(task_id, store.now() - timedelta(seconds=1))
    time.sleep(1.2)
    stats = sweep(app)
    assert stats.expired == 1
    assert stats.sent == 1
    assert store.get(soon.id).status == C.STATUS_EXPIRED  # type: ignore[union-attr]
    assert store.get(live.id).status == C.STATUS_SENT  # type: ignore[union-attr]
    assert [m["headers"]["id"] for m in published.messages] == [live.id]
    assert published.messages[0]["headers"]["expires"] is not None


def test_retry_signature_and_chain_go_through_the_store(app: Celery, published: Published) -> None:
    t = tasks(app)
    sig = t["add"].s(2, 3).set(countdown=3600)
    res = sig.apply_async()
    assert get_store(app).get(res.id) is not None
    c = chain(t["add"].s(1, 2).set(countdown=3600), t["record"].si("after"))
    chained = c.apply_async()
    first_id = chained.parent.id if chained.parent is not None else chained.id
    row = get_store(app).get(first_id)
    assert row is not None
    body = json.loads(row.payload)
    assert body["options"]["chain"][0]["task"] == "tests.delays.record"
    assert published.messages == []
