"""Issue 19 for unique tasks (issue 17): ``assert_unique_held`` / ``assert_unique_free`` on the in-process
lock store, through the real ``SafeTask`` path; no Redis, no broker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery import Celery

from celery_safe_time import SafeTask
from celery_safe_time.exceptions import UniqueConflict
from celery_safe_time.locks.admin import list_locks, release_lock
from celery_safe_time.testing import SafeTimeTesting, assert_unique_free, assert_unique_held, safe_time_testing


@pytest.fixture
def app() -> Celery:
    return Celery("unique-helpers", broker="memory://", set_as_current=False)


def test_held_while_queued_and_stored_free_after_the_run(app: Celery) -> None:
    @app.task(base=SafeTask, unique="export:{user_id}", shared=False)
    def export(user_id: int) -> int:
        return user_id

    with safe_time_testing(app) as st:
        first = export.delay(7)
        assert export.delay(user_id=7).id == first.id
        info = st.assert_unique_held("export:7", task_id=first.id, state="queued")
        assert info.key == "unique:export:7"
        assert_unique_held("export:7", app=app)
        with pytest.raises(AssertionError, match="is queued, not running"):
            st.assert_unique_held("export:7", state="running")
        with pytest.raises(AssertionError, match=f"held by task {first.id}"):
            st.assert_unique_free("export:7")

        stored = export.apply_async((8,), countdown=timedelta(days=14).total_seconds())
        assert export.apply_async((8,), countdown=60).id == stored.id
        st.assert_unique_held("export:8", task_id=stored.id, state="stored")
        assert [i.key for i in list_locks(app)] == ["unique:export:7", "unique:export:8"]
        [ran] = st.run_due(advance=timedelta(days=14, seconds=1))
        assert (ran.id, ran.state, ran.result) == (stored.id, "SUCCESS", 8)
        assert_unique_free("export:8", app=app)

        assert release_lock(app, "unique:export:7") is not None
        st.assert_unique_free("export:7")
        with pytest.raises(AssertionError, match=r"'export:7' is not held \(held: none\)"):
            st.assert_unique_held("export:7")


def test_cancel_frees_and_raise_names_the_holder(safe_time: SafeTimeTesting) -> None:
    @safe_time.app.task(base=SafeTask, unique="r:{n}", unique_on_conflict="raise", shared=False)
    def report(n: int) -> int:
        return n

    first = report.apply_async((1,), countdown=3600)
    with pytest.raises(UniqueConflict) as caught:
        report.apply_async((1,), countdown=3600)
    assert (caught.value.key, caught.value.holder, caught.value.state) == ("r:1", first.id, "stored")
    first.revoke()
    safe_time.assert_unique_free("r:1")
    safe_time.assert_not_stored(report)
