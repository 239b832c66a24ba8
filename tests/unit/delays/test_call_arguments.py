"""Issue 40, trap 3: ``countdown``, ``eta``, ``expires`` (and ``reschedule``'s) as Celery takes them, or a
``TypeError``/``ValueError`` naming the parameter at the call site, with nothing stored."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import SafeTask, idempotent, overlap_lock, reschedule
from celery_safe_time.testing import SafeTimeTesting, safe_time_testing


@pytest.fixture
def st() -> Iterator[SafeTimeTesting]:
    app = Celery("call-arguments-unit", broker="memory://", set_as_current=False)
    with safe_time_testing(app, threshold=60) as handle:
        yield handle


def _task(st: SafeTimeTesting) -> Any:
    @st.app.task(base=SafeTask, shared=False, name="tests.arguments.report")
    def report(n: int) -> int:
        return n

    return report


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"countdown": "3600"}, TypeError, "countdown"),  # was stored as 3600 s
        ({"countdown": "10"}, TypeError, "countdown"),  # was Celery's "'<' not supported"
        ({"countdown": "abc"}, TypeError, "countdown"),  # was "could not convert string to float"
        ({"countdown": True}, TypeError, "countdown"),
        ({"countdown": float("nan")}, ValueError, "countdown"),
        ({"eta": "abc"}, ValueError, "eta"),
        ({"eta": 3600}, TypeError, "eta"),
        ({"countdown": 3600, "expires": "abc"}, ValueError, "expires"),
        ({"countdown": 3600, "expires": [1]}, TypeError, "expires"),
        ({"countdown": 10, "expires": "abc"}, ValueError, "expires"),
    ],
)
def test_a_bad_time_option_names_its_parameter_and_stores_nothing(
    st: SafeTimeTesting, options: dict[str, Any], error: type[Exception], name: str
) -> None:
    report = _task(st)
    with pytest.raises(error, match=rf"^{name} must be"):
        report.apply_async((1,), **options)
    assert st.stored_delays() == []


def test_a_bad_time_option_in_a_batch_stores_nothing_of_it(st: SafeTimeTesting) -> None:
    report = _task(st)
    with pytest.raises(TypeError, match=r"apply_many item 1: countdown must be") as caught:
        report.apply_many([((1,), {}, {"countdown": 3600}), ((2,), {}, {"countdown": "3600"})])
    assert caught.value.index == 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"apply_many item 1: expires must be"):
        report.apply_many([((1,), {}, {"countdown": 3600}), ((2,), {}, {"expires": "soon"})])
    assert st.stored_delays() == []


def test_what_celery_takes_is_taken(st: SafeTimeTesting) -> None:
    report = _task(st)
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    report.apply_async((1,), countdown=3600)
    report.apply_async((2,), countdown=3600.5, expires=7200)
    report.apply_async((3,), eta=later)
    report.apply_async((4,), eta=later.isoformat(), expires=(later + timedelta(hours=1)).isoformat())
    assert sorted(d.args for d in st.stored_delays()) == [(1,), (2,), (3,), (4,)]


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [({"countdown": "abc"}, TypeError, "countdown"), ({"eta": "abc"}, ValueError, "eta")],
)
def test_reschedule_names_a_bad_parameter_and_changes_nothing(
    st: SafeTimeTesting, options: dict[str, Any], error: type[Exception], name: str
) -> None:
    result = _task(st).apply_async((1,), countdown=3600)
    [before] = st.stored_delays()
    with pytest.raises(error, match=rf"^{name} must be"):
        reschedule(result.id, app=st.app, **options)
    [after] = st.stored_delays()
    assert after.due_at == before.due_at


@pytest.mark.parametrize(
    ("decorator", "name"),
    [
        (lambda: idempotent("k:{n}", window="forever"), "window"),
        (lambda: idempotent("k:{n}", window=0), "window"),
        (lambda: idempotent("k:{n}", ttl="600"), "ttl"),
        (lambda: overlap_lock("k:{n}", ttl="600"), "ttl"),
        (lambda: overlap_lock("k:{n}", ttl=float("inf")), "ttl"),
    ],
)
def test_lock_durations_are_checked_at_decoration_time(decorator: Any, name: str) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"^{name} must be"):
        decorator()


def test_lock_durations_take_numbers_and_timedeltas() -> None:
    idempotent("k:{n}", window=timedelta(days=40), ttl=600)
    overlap_lock("k:{n}", ttl=timedelta(minutes=10))
    idempotent("k:{n}", window=40 * 86400)
