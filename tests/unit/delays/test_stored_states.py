"""What a stored call reports to the result backend when it never runs: Celery's REVOKED, chord errors
included (the real sweep and ``cancel``, on the testing kit's store and an in-memory result backend)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chord, states
from celery.exceptions import ChordError, TaskRevokedError

from celery_safe_time import SafeTask, cancel
from celery_safe_time import constants as C
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.testing import SafeTimeTesting, safe_time_testing

HOUR = 3600


@pytest.fixture
def st() -> Iterator[SafeTimeTesting]:
    app = Celery("stored-states", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.task_store_errors_even_if_ignored = False
    with safe_time_testing(app, threshold=60, store="memory") as handle:
        yield handle


def _tasks(app: Celery) -> tuple[Any, Any]:
    @app.task(base=SafeTask, shared=False, name="tests.states.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(base=SafeTask, shared=False, name="tests.states.total")
    def total(values: list[int]) -> int:
        return sum(values)

    return add, total


def test_a_call_that_expires_in_the_store_is_revoked_with_celerys_reason(st: SafeTimeTesting) -> None:
    add, _ = _tasks(st.app)
    result = add.apply_async((1, 2), countdown=HOUR, expires=60)
    assert result.state == states.PENDING
    st.advance(HOUR + 1)
    stats = sweep(st.app)
    assert stats.expired == 1
    row = get_store(st.app).get(result.id)
    assert row is not None
    assert row.status == C.STATUS_EXPIRED
    assert result.state == states.REVOKED
    with pytest.raises(TaskRevokedError, match="expired"):
        result.get(timeout=1)


def test_a_chord_whose_header_expired_in_the_store_fails_as_celerys(st: SafeTimeTesting) -> None:
    add, total = _tasks(st.app)
    header = [add.s(1, 1).set(countdown=HOUR, expires=60), add.s(2, 2).set(countdown=HOUR, expires=60)]
    result = chord(header)(total.s())
    st.advance(HOUR + 1)
    sweep(st.app)
    assert result.state == states.FAILURE
    # As Celery's worker leaves it on this backend: the callback fails with the dependency's error
    # (the Redis backend's ChordError names the dependency: tests/integration/delays/test_stored_states.py).
    with pytest.raises((ChordError, TaskRevokedError), match="expired"):
        result.get(timeout=1)


def test_a_cancelled_or_revoked_stored_call_reports_revoked(st: SafeTimeTesting) -> None:
    add, _ = _tasks(st.app)
    cancelled = add.apply_async((1, 2), countdown=HOUR)
    revoked = add.apply_async((3, 4), countdown=HOUR)
    assert cancel(cancelled.id, app=st.app)
    revoked.revoke()
    for result in (cancelled, revoked):
        assert result.state == states.REVOKED
        with pytest.raises(TaskRevokedError, match="revoked"):
            result.get(timeout=1)
    # Cancelled once: a second cancel changes nothing and reports nothing again.
    assert not cancel(cancelled.id, app=st.app)


def test_a_cancelled_chord_member_fails_its_chord(st: SafeTimeTesting) -> None:
    add, total = _tasks(st.app)
    header = [add.s(1, 1).set(countdown=HOUR), add.s(2, 2).set(countdown=HOUR)]
    result = chord(header)(total.s())
    for member in get_store(st.app).list():
        cancel(member.id, app=st.app)
    assert result.state == states.FAILURE
    with pytest.raises((ChordError, TaskRevokedError), match="revoked"):
        result.get(timeout=1)


def test_a_published_call_whose_expiry_passed_is_closed_without_waiting_for_the_grace(st: SafeTimeTesting) -> None:
    add, _ = _tasks(st.app)
    result = add.apply_async((1, 2), countdown=HOUR, expires=HOUR + 30)
    st.advance(HOUR - 1)
    sweep(st.app, lookahead=5)  # published ahead with its eta; no worker takes it
    row = get_store(st.app).get(result.id)
    assert row is not None
    assert row.status == C.STATUS_SENT
    st.advance(60)  # past its expiry, far inside the delivery grace
    stats = sweep(st.app)
    row = get_store(st.app).get(result.id)
    assert row is not None
    assert row.status == C.STATUS_EXPIRED
    assert stats.expired == 1
    assert result.state == states.REVOKED


def test_run_due_of_the_testing_kit_reports_an_expired_call_revoked(st: SafeTimeTesting) -> None:
    add, _ = _tasks(st.app)
    result = add.apply_async((1, 2), countdown=HOUR, expires=60)
    [ran] = st.run_due(advance=HOUR + 1)
    assert ran.state == "EXPIRED"
    assert result.state == states.REVOKED


def test_a_published_call_a_worker_already_discarded_as_expired_is_not_reported_twice(st: SafeTimeTesting) -> None:
    """The worker's own report counted the chord part: the sweep that closes the row adds none."""
    add, _ = _tasks(st.app)
    result = add.apply_async((1, 2), countdown=HOUR, expires=HOUR + 30)
    st.advance(HOUR - 1)
    sweep(st.app, lookahead=5)
    st.advance(60)
    st.app.backend.mark_as_revoked(result.id, "expired by the worker")  # what the worker did
    assert sweep(st.app).expired == 1
    row = get_store(st.app).get(result.id)
    assert row is not None
    assert row.status == C.STATUS_EXPIRED
    assert str(result.result) == "expired by the worker"


def test_an_expired_stored_unique_call_frees_its_key_when_the_sweep_closes_it(st: SafeTimeTesting) -> None:
    @st.app.task(base=SafeTask, shared=False, name="tests.states.export", unique="export:{user}")
    def export(user: int) -> int:
        return user

    first = export.apply_async((7,), countdown=HOUR, expires=60)
    assert export.apply_async((7,), countdown=HOUR).id == first.id  # the key is held
    st.advance(HOUR + 1)
    assert sweep(st.app).expired == 1
    assert first.state == states.REVOKED
    assert export.apply_async((7,), countdown=HOUR).id != first.id  # freed with the REVOKED report
