"""Issue 40, trap 6: ``rerun(task_id)`` runs a failed row again, once, through the testing kit's sweep."""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_safe_time import SafeTask, rerun, reschedule
from celery_safe_time import constants as C
from celery_safe_time.testing import safe_time_testing


def test_a_row_failed_for_an_unknown_task_runs_once_after_rerun() -> None:
    app = Celery("rerun-unit", broker="memory://", set_as_current=False)
    ran: list[int] = []

    @app.task(base=SafeTask, shared=False, name="tests.rerun.report")
    def report(n: int) -> None:
        ran.append(n)

    with safe_time_testing(app, threshold=60) as st:
        result = report.apply_async((7,), countdown=3600)
        task: Any = app.tasks.pop(report.name)  # the deploy that lacks the task
        [failed] = st.run_due(advance=3601, propagate=False)
        assert failed.state == "FAILED"
        assert st.store.get(result.id).status == C.STATUS_FAILED  # type: ignore[union-attr]
        app.tasks[report.name] = task  # deployed
        assert not reschedule(result.id, countdown=0, app=app)
        assert rerun(result.id, app=app)
        assert not rerun(result.id, app=app)
        assert [r.state for r in st.run_due()] == ["SUCCESS"]
        assert st.run_due(advance=3600) == []
        assert ran == [7]
