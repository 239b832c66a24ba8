"""celery_safe_time.messages.compat behaves as the newest Celery and kombu do, whichever is installed.

make compat runs these on Celery 5.4 (the fallbacks) and on Celery 5.7 (the libraries' own names).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from celery import Celery
from kombu import Queue
from kombu.exceptions import KombuError

from celery_safe_time import SafeTask
from celery_safe_time.messages import compat


def test_subtract_datetimes_takes_a_naive_datetime_as_utc() -> None:
    aware = datetime(2026, 3, 29, 3, 30, tzinfo=ZoneInfo("Europe/Berlin"))  # 01:30 UTC
    assert compat.subtract_datetimes(aware, datetime(2026, 3, 29, 1, 0)) == timedelta(minutes=30)
    assert compat.subtract_datetimes(datetime(2026, 1, 1), datetime(2026, 1, 1, tzinfo=timezone.utc)) == timedelta(0)


def test_batch_publish_error_is_a_kombu_error_the_sweep_can_catch() -> None:
    assert issubclass(compat.BatchPublishError, KombuError)


def test_quorum_queues_are_detected_on_amqp_only() -> None:
    app = Celery("q", broker="memory://", set_as_current=False)
    assert compat.detect_quorum_queues(app, "redis") == (False, "")
    assert compat.detect_quorum_queues(app, "amqp") == (False, "")


def test_quorum_queue_detection_names_the_queue_where_celery_knows_them() -> None:
    app = Celery("q", broker="memory://", set_as_current=False)
    app.conf.task_queues = [Queue("jobs", queue_arguments={"x-queue-type": "quorum"})]
    found, name = compat.detect_quorum_queues(app, "amqp")
    # Celery 5.4 has no quorum-queue helper (nor native delayed delivery on them): "no" there.
    assert (found, name) in {(True, "jobs"), (False, "")}


def test_a_request_pushed_inside_a_running_task_keeps_its_id_retries_and_headers() -> None:
    app = Celery("c", broker="memory://", set_as_current=False)

    @app.task(base=SafeTask, name="c.t", shared=False)
    def t() -> None: ...

    t.push_request(id="abc", retries=2, headers={"h": 1}, called_directly=False)
    try:
        t.push_request(args=(1,), kwargs={})  # what Task.__call__ pushes for the body
        assert (t.request.id, t.request.retries, t.request.headers) == ("abc", 2, {"h": 1})
        assert t.request.args == (1,)
        assert not t.request.called_directly
        t.pop_request()
    finally:
        t.pop_request()


def test_an_eta_under_a_second_ahead_moves_to_one_native_delayed_delivery_can_route() -> None:
    now = datetime(2026, 12, 3, 8, 0, tzinfo=timezone.utc)
    routed = compat.routable_eta(now + timedelta(seconds=0.4), now)
    assert routed == now + timedelta(seconds=1.25)  # late by 0.85 s, never early
    assert int(compat.subtract_datetimes(routed, now).total_seconds()) >= 1  # what kombu's router takes
    assert compat.routable_eta(now + timedelta(seconds=5), now) == now + timedelta(seconds=5)
    assert compat.routable_eta(now - timedelta(seconds=3), now) == now - timedelta(seconds=3)  # past: no delay


def test_a_countdown_under_a_second_is_one_second_on_quorum_queues_only() -> None:
    plain = Celery("plain", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    assert compat.routable_countdown(plain, 0.3) == 0.3
    quorum = Celery("quorum", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    quorum.conf.task_queues = [Queue("jobs", queue_arguments={"x-queue-type": "quorum"})]
    native = compat.detect_quorum_queues(quorum, "amqp")[0]  # Celery 5.4: no native delayed delivery
    assert compat.routable_countdown(quorum, 0.3) == (1.0 if native else 0.3)
    assert compat.routable_countdown(quorum, 2.5) == 2.5
    assert compat.routable_countdown(quorum, 0) == 0
