"""What the in-process beat tests share: the slots their schedulers publish, and a leader of the
test module's ``app`` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import signals
from celery_safe_time.beat.scheduler import SafeScheduler
from tests.helpers.processes import wait_for


@pytest.fixture
def sent() -> Iterator[list[dict[str, Any]]]:
    """Every slot the schedulers of this test published: {"entry", "slot", "epoch", "task_id"}."""
    out: list[dict[str, Any]] = []

    def on_sent(sender: Any, **kw: Any) -> None:
        out.append(kw)

    signals.beat_slot_dispatched.connect(on_sent, weak=False)
    yield out
    signals.beat_slot_dispatched.disconnect(on_sent)


@pytest.fixture
def leader(app: Celery, tmp_path: Path) -> Iterator[SafeScheduler]:
    """An in-process scheduler of the module's ``app`` holding the lease, its term's reconcile ticked."""
    sched = SafeScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    wait_for(lambda: sched.keeper.is_leader, 10, message="leadership")
    sched.tick()  # the term's reconcile
    yield sched
    sched.close()
