"""celery_safe_time.compat behaves as the newest Celery and kombu do, whichever is installed.

make compat runs these on Celery 5.4 (the fallbacks) and on Celery 5.7 (the libraries' own names).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from celery import Celery
from kombu import Queue
from kombu.exceptions import KombuError

from celery_safe_time import SafeTask, compat


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
