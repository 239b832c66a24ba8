"""``idempotent``'s commit after the body returned, through a backend outage, with injected time.

The soak (PostgreSQL coordination, seed 908223) ran one key twice: the body returned as the server
crashed, the commit's pauses grew to 8 s, the server was back before the in-progress lease ended but
the next attempt came after it, and another call of the key took the lease and ran. The pauses now
stay under a third of what is left of the lease.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import idempotent
from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner, use_lock_backend
from celery_safe_time.locks.idempotency import IDEMPOTENT_COMMIT_MIN_PAUSE, commit_pause
from celery_safe_time.testing import MemoryLockBackend

OTHER = Owner(task_id="t2", identity="delivery-2", host=socket.gethostname(), pid=os.getpid())


@pytest.mark.parametrize(
    ("scheduled", "budget_left", "lease_left", "expected"),
    [
        (0.1, 30.0, 15.0, 0.1),  # early: the schedule
        (8.0, 19.0, 4.0, 4.0 / 3.0),  # near the lease's end: a third of what is left
        (8.0, 19.0, 0.15, IDEMPOTENT_COMMIT_MIN_PAUSE),  # never below the floor
        (8.0, 19.0, -1.0, 8.0),  # the lease has ended: the schedule again
        (8.0, 2.0, 30.0, 2.0),  # never past the budget
        (8.0, 0.0, 30.0, None),  # the budget is spent: give up
    ],
)
def test_a_commit_pause_stays_inside_the_lease_and_the_budget(
    scheduled: float, budget_left: float, lease_left: float, expected: float | None
) -> None:
    assert commit_pause(scheduled, budget_left, lease_left) == (
        expected if expected is None else pytest.approx(expected)
    )


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _DownUntil(MemoryLockBackend):
    """A memory backend whose commits fail (as an unreachable server) until ``back_at``."""

    def __init__(self, app: Celery, clock: _Clock, back_at: float) -> None:
        super().__init__(get_config(app), clock=clock)
        self.lease_clock = clock
        self.back_at = back_at
        self.committed_at: float | None = None
        self.clock = clock

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        if self.clock.now < self.back_at:
            raise ConnectionRefusedError("the coordination server is down")
        self.committed_at = self.clock.now
        return super().commit(*args, **kwargs)


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("idempotent-commit", broker="redis://127.0.0.1:1/0", set_as_current=False)  # never reached
    yield app
    use_lock_backend(app, None)
    app.close()


def test_a_backend_back_before_the_lease_ends_records_the_key_before_another_call_can_take_it(app: Celery) -> None:
    """ttl 15 s, the server down for the body's last moment and 12 s after: the old pauses (0.1 ...
    5.0, then 8.0) came back at +19 s, 4 s after the lease ended; now the key is recorded before."""
    clock = _Clock(1000.0)
    backend = _DownUntil(app, clock, back_at=1012.0)
    use_lock_backend(app, backend)

    @app.task(name="commit.ship")
    @idempotent("ship:{n}", ttl=15)
    def ship(n: int) -> str:
        return "shipped"

    [lock] = ship.run.__safe_time_locks__
    pauses: list[tuple[float, float]] = []

    def sleep(seconds: float) -> None:
        pauses.append((seconds, 1015.0 - clock.now))
        clock.now += seconds

    lock.sleep = sleep
    assert ship(1) == "shipped"

    assert backend.committed_at is not None
    assert backend.committed_at < 1015.0, pauses  # before the in-progress lease ended
    for pause, lease_left in pauses:
        assert pause <= max(IDEMPOTENT_COMMIT_MIN_PAUSE, lease_left / 3.0) + 1e-9, pauses
    # Recorded: another call of the key after the lease is skipped, not run.
    clock.now = 1100.0
    later = backend.acquire(C.IDEMPOTENT_LOCK_NAMESPACE + "ship:1", "t2-token", 15.0, OTHER, marker="ship:1")
    assert later.status == "done"
