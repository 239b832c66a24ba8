"""celery_safe_time.testing: stored delays, run_due on a test clock, locks, next_fires; no Redis, no broker."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import crontab, idempotent, overlap_lock
from celery_safe_time.config import get_config
from celery_safe_time.delays.backends import get_store
from celery_safe_time.testing import (
    NO_REDIS_URL,
    SafeTimeTesting,
    TestStore,
    assert_stored,
    next_fires,
    run_due,
    safe_time_testing,
    stored_delays,
)

UTC = timezone.utc
DAY = 86400


@pytest.fixture
def app() -> Celery:
    return Celery("plugin-test", broker="memory://", task_cls="celery_safe_time:SafeTask", set_as_current=False)


def test_a_fresh_app_needs_no_redis_and_uses_the_test_store(safe_time: SafeTimeTesting) -> None:
    config = get_config(safe_time.app)
    assert config.redis_url == NO_REDIS_URL
    assert config.delay_threshold == 0
    assert isinstance(get_store(safe_time.app), TestStore)


def test_stored_call_is_asserted_then_runs_in_due_order_on_the_test_clock(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app
    ran: list[tuple[str, datetime]] = []

    @app.task(name="t.remind")
    def remind(user_id: int, kind: str = "trial") -> str:
        ran.append((f"{kind}:{user_id}", safe_time.now()))
        return f"sent {user_id}"

    remind.apply_async((2,), {"kind": "late"}, countdown=14 * DAY)
    remind.apply_async((1,), countdown=3 * DAY)
    found = assert_stored(remind, args=(1,), due_within=timedelta(days=3, minutes=1))
    assert found.kwargs == {}
    safe_time.assert_stored("t.remind", args=(2,), kwargs={"kind": "late"}, due_after=timedelta(days=13))
    safe_time.assert_stored(remind, count=2)
    with pytest.raises(AssertionError, match=r"no stored t\.remind"):
        safe_time.assert_stored(remind, args=(3,))
    with pytest.raises(AssertionError, match="due within"):
        safe_time.assert_stored(remind, args=(2,), due_within=timedelta(days=1))
    start = safe_time.now()

    assert run_due(advance=timedelta(days=2)) == []
    results = safe_time.run_due(advance=timedelta(days=12, minutes=1))

    assert [r.state for r in results] == ["SUCCESS", "SUCCESS"]
    assert [r.result for r in results] == ["sent 1", "sent 2"]
    assert [name for name, _ in ran] == ["trial:1", "late:2"]
    # Each ran when the test clock reached its due time.
    assert abs((ran[0][1] - start).total_seconds() - 3 * DAY) < 5
    assert abs((ran[1][1] - start).total_seconds() - 14 * DAY) < 5
    assert stored_delays() == []
    rows = safe_time.stored_delays(status=None)
    assert {(r.status, r.row.outcome) for r in rows} == {("finished", "succeeded")}


def test_what_a_run_stores_counts_from_its_due_time_and_runs_if_due(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app
    runs: list[int] = []

    @app.task(name="t.daily")
    def daily(n: int) -> None:
        runs.append(n)
        daily.apply_async((n + 1,), countdown=DAY)

    daily.apply_async((1,), countdown=DAY)
    safe_time.run_due(advance=timedelta(days=3, hours=1))
    assert runs == [1, 2, 3]
    safe_time.assert_stored(daily, args=(4,), due_within=timedelta(hours=23, minutes=1))


def test_retry_with_a_countdown_is_stored_not_rerun_at_once(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app
    attempts: list[int] = []

    @app.task(name="t.flaky", bind=True, max_retries=3)
    def flaky(self: Any) -> str:
        attempts.append(self.request.retries)
        if len(attempts) < 3:
            raise self.retry(countdown=3600)
        return "ok"

    flaky.apply_async(countdown=60)
    first = safe_time.run_due(advance=timedelta(minutes=2))
    assert [r.state for r in first] == ["RETRY"]
    safe_time.assert_stored(flaky, due_within=timedelta(hours=1))
    rest = safe_time.run_due(advance=timedelta(hours=3))
    assert [r.state for r in rest] == ["RETRY", "SUCCESS"]
    assert attempts == [0, 1, 2]


def test_a_task_error_is_raised_unless_propagate_is_false(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app

    @app.task(name="t.boom")
    def boom() -> None:
        raise ValueError("boom")

    same_time = safe_time.now() + timedelta(seconds=10)
    boom.apply_async(eta=same_time)
    boom.apply_async(eta=same_time)  # claimed in the same batch as the first
    boom.apply_async(countdown=20)
    with pytest.raises(ValueError, match="boom"):
        safe_time.run_due(advance=15)
    assert len(safe_time.stored_delays(boom)) == 2  # the other row due at 10 s is pending again
    results = safe_time.run_due(advance=60, propagate=False)
    assert [r.state for r in results] == ["FAILURE", "FAILURE"]
    assert isinstance(results[0].result, ValueError)


def test_cancelled_and_expired_rows_do_not_run(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app
    ran: list[str] = []

    @app.task(name="t.note")
    def note(what: str) -> None:
        ran.append(what)

    note.apply_async(("cancelled",), countdown=DAY).revoke()
    note.apply_async(("expired",), countdown=DAY, expires=60)
    note.apply_async(("runs",), countdown=DAY)
    results = safe_time.run_due(advance=timedelta(days=2))
    assert ran == ["runs"]
    assert sorted(r.state for r in results) == ["EXPIRED", "SUCCESS"]


def test_idempotency_key_and_module_helpers_need_the_app_when_several_are_active(app: Celery) -> None:
    other = Celery("other", broker="memory://", task_cls="celery_safe_time:SafeTask", set_as_current=False)

    @app.task(name="t.one")
    def one() -> None: ...

    with safe_time_testing(app), safe_time_testing(other):
        first = one.apply_async(countdown=100, idempotency_key="k")
        second = one.apply_async(countdown=100, idempotency_key="k")
        assert first.id == second.id
        assert len(stored_delays(one)) == 1  # the task names its app
        with pytest.raises(RuntimeError, match="pass app="):
            run_due(10)
        assert run_due(200, app=app)[0].id == first.id


def test_the_app_is_restored_afterwards(app: Celery) -> None:
    app.conf.safe_time_store_url = "sqlite:///x.sqlite3"
    with safe_time_testing(app):
        assert get_config(app).store_url == "memory://testing"
    assert app.conf.safe_time_store_url == "sqlite:///x.sqlite3"
    assert app.conf.get("safe_time_redis_url") is None
    assert app.conf.task_always_eager is False
    with pytest.raises(Exception, match="safe_time_redis_url"):
        get_config(Celery("prod", broker="amqp://", set_as_current=False))


def test_always_eager_is_off_inside_so_countdowns_are_stored(app: Celery) -> None:
    app.conf.task_always_eager = True

    @app.task(name="t.eager")
    def eager() -> None: ...

    with safe_time_testing(app) as st:
        eager.apply_async(countdown=DAY)
        st.assert_stored(eager)
    assert app.conf.task_always_eager is True


def test_overlap_lock_held_during_the_run_and_free_after(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app
    seen: list[int | None] = []

    @app.task(name="t.sync", bind=True)
    @overlap_lock("sync:{account_id}", ttl=60)
    def sync(self: Any, account_id: int) -> None:
        info = safe_time.assert_lock_held(f"sync:{account_id}")
        seen.append(info.fence)
        assert self.request.safe_time_fence == info.fence
        safe_time.assert_lock_free("sync:2")

    sync.apply_async((1,), countdown=10)
    sync.apply_async((1,), countdown=20)
    safe_time.run_due(advance=30)
    safe_time.assert_lock_free("sync:1")
    assert len(seen) == 2
    assert seen[0] is not None
    assert seen[1] is not None
    assert seen[1] > seen[0]
    with pytest.raises(AssertionError, match="not held"):
        safe_time.assert_lock_held("sync:1")


def test_a_lock_conflict_requeues_into_the_store_and_runs_later(safe_time: SafeTimeTesting) -> None:
    from celery_safe_time.locks.backends import Owner

    app = safe_time.app
    ran: list[str] = []

    @app.task(name="t.guarded", bind=True)
    @overlap_lock("acct:{n}", ttl=600, retry_after=30)
    def guarded(self: Any, n: int) -> None:
        ran.append(f"ran {n}")

    # Somebody else holds the lock for 100 s (test-time 0 is the real clock; the lock store's clock is real).
    safe_time.locks.acquire("acct:1", "other-token", 100, Owner("other", "other:1", "h", 1))
    guarded.apply_async((1,), countdown=5)
    results = safe_time.run_due(advance=10)
    assert [r.state for r in results] == ["RETRY"]
    assert ran == []
    safe_time.assert_stored(guarded, args=(1,), due_within=timedelta(seconds=60))
    safe_time.locks.release("acct:1", "other-token")
    safe_time.run_due(advance=120)
    assert ran == ["ran 1"]


def test_idempotent_key_runs_once_and_is_asserted(safe_time: SafeTimeTesting) -> None:
    app = safe_time.app
    sent: list[str] = []

    @app.task(name="t.invoice")
    @idempotent("invoice:{tenant}:{period}", window=40 * DAY)
    def invoice(tenant: int, period: str) -> None:
        sent.append(f"{tenant}:{period}")

    safe_time.assert_idempotent_free("invoice:1:2026-11")
    invoice.apply_async((1, "2026-11"), countdown=DAY)
    invoice.apply_async((1, "2026-11"), countdown=2 * DAY)
    safe_time.run_due(advance=timedelta(days=3))
    assert sent == ["1:2026-11"]
    safe_time.assert_idempotent_done("invoice:1:2026-11")
    with pytest.raises(AssertionError, match="has not run"):
        safe_time.assert_idempotent_done("invoice:2:2026-11")


def test_next_fires_follow_the_dst_rules() -> None:
    # Europe/Berlin springs forward on 2026-03-29: 02:30 does not exist, the job runs once at 03:00 local.
    job = crontab(minute=30, hour=2, tz="Europe/Berlin")
    fires = next_fires(job, n=3, after=datetime(2026, 3, 27, 12, tzinfo=UTC))
    assert fires == [
        datetime(2026, 3, 28, 1, 30, tzinfo=UTC),  # 02:30 CET
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),  # the gap: at the transition (03:00 CEST)
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),  # 02:30 CEST
    ]
    # Fall back on 2026-10-25: an hourly job runs in both passes of 02:xx.
    hourly = crontab(minute=0, tz="Europe/Berlin")
    fires = next_fires({"task": "x", "schedule": hourly}, n=4, after=datetime(2026, 10, 24, 23, 30, tzinfo=UTC))
    assert [f.hour for f in fires] == [0, 1, 2, 3]  # 02:00 CEST, 02:00 CET, 03:00 CET, 04:00 CET


def test_next_fires_of_intervals_and_plain_crontabs_in_the_app_timezone(app: Celery) -> None:
    from celery.schedules import crontab as celery_crontab

    after = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)
    assert next_fires(timedelta(minutes=10), n=3, after=after) == [
        after,
        after + timedelta(minutes=10),
        after + timedelta(minutes=20),
    ]
    app.conf.timezone = "America/New_York"
    fires = next_fires(celery_crontab(minute=0, hour=9), n=1, after=after, app=app)
    assert fires == [datetime(2026, 1, 1, 14, 0, tzinfo=UTC)]
    assert next_fires(celery_crontab(minute=0, hour=9), n=1, after=after, tz="UTC") == [
        datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
    ]


WITHOUT_PYTEST = """
import sys
sys.modules["pytest"] = None  # importing pytest now fails: the helpers must not need it
from datetime import timedelta
from celery import Celery
from celery_safe_time.testing import safe_time_testing

app = Celery("plain", task_cls="celery_safe_time:SafeTask", set_as_current=False)
ran = []

@app.task(name="plain.remind")
def remind(x):
    ran.append(x)

with safe_time_testing(app) as st:
    remind.apply_async((1,), countdown=14 * 86400)
    st.assert_stored(remind, args=(1,), due_within=timedelta(days=14, seconds=5))
    st.run_due(advance=timedelta(days=15))
assert ran == [1], ran
print("OK without pytest")
"""


def test_the_helpers_work_without_pytest() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", WITHOUT_PYTEST], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK without pytest" in result.stdout


#: A deployment's settings, every service on a closed port: reaching any of them fails (or hangs).
PRODUCTION_SETTINGS: dict[str, Any] = {
    "broker_url": "amqp://guest:guest@127.0.0.1:1//",
    "result_backend": "redis://127.0.0.1:1/0",
    "safe_time_redis_url": "redis://127.0.0.1:1/0",
    "safe_time_store_url": "postgresql+psycopg://app:secret@127.0.0.1:1/prod",
    "safe_time_coordination_url": "store",
    "safe_time_coordination_locks": "session",
}


def test_an_app_with_production_settings_gets_the_in_process_set_up_and_reaches_none_of_its_services() -> None:
    app = Celery("prod", task_cls="celery_safe_time:SafeTask", set_as_current=False)
    app.conf.update(PRODUCTION_SETTINGS)
    ran: list[str] = []

    @app.task(name="prod.sync", shared=False)
    @overlap_lock("sync:{n}")
    def sync(n: int) -> int:
        ran.append(f"sync:{n}")
        return n

    @app.task(name="prod.invoice", shared=False)
    @idempotent("invoice:{n}", window=DAY)
    def invoice(n: int) -> None:
        ran.append(f"invoice:{n}")

    with safe_time_testing(app) as st:
        config = get_config(app)
        assert (config.coordination, config.redis_url, config.store_url) == ("redis", NO_REDIS_URL, "memory://testing")
        sync.apply_async((1,), countdown=DAY)
        invoice.apply_async((7,), countdown=DAY)
        invoice.apply_async((7,), countdown=2 * DAY)
        st.run_due(advance=3 * DAY)
        st.assert_idempotent_done("invoice:7")
        # an immediate call: to the block's broker and result backend, not the deployment's
        with app.connection_for_write() as conn:
            assert conn.transport_cls == "memory"
        assert type(app.backend).__name__ == "CacheBackend"
        with app.connection_for_read() as conn:
            queue = conn.SimpleQueue("celery", no_ack=True)
            queue.clear()  # the memory transport is this process's: another test's message may wait
            result = sync.delay(2)
            assert queue.get(timeout=1).headers["id"] == result.id
    assert ran == ["sync:1", "invoice:7"]
    assert {key: app.conf[key] for key in PRODUCTION_SETTINGS} == PRODUCTION_SETTINGS
