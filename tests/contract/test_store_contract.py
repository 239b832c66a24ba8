"""One contract for every delayed-task store: memory, SQLAlchemy (SQLite, PostgreSQL), Django ORM."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from celery_safe_time import constants as C
from celery_safe_time.delays.backends.base import DelayStore
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.exceptions import PurgeRefused, StoreError
from tests.helpers.delays import fresh_sql_store, new_delay

pytestmark = pytest.mark.integration


def test_now_is_aware_utc_and_close_to_local(any_store: DelayStore) -> None:
    now = any_store.now()
    assert now.utcoffset() == timedelta(0)
    assert abs(now.timestamp() - time.time()) < 5
    any_store.ping()


def test_insert_and_get_round_trip(any_store: DelayStore) -> None:
    due = any_store.now() + timedelta(hours=2)
    expires = due + timedelta(hours=1)
    result = any_store.insert(new_delay("t1", due, expires_at=expires, payload=b"\x00\xffraw"))
    assert result.task_id == "t1"
    assert result.created
    row = any_store.get("t1")
    assert row is not None
    assert row.payload == b"\x00\xffraw"
    assert row.status == C.STATUS_PENDING
    assert row.due_at == due
    assert row.due_at.utcoffset() == timedelta(0)
    assert row.expires_at == expires
    assert row.attempts == 0
    assert row.task == "tests.delays.record"
    assert any_store.get("missing") is None


def test_pending_task_id_cannot_be_stored_twice_but_finished_one_is_replaced(any_store: DelayStore) -> None:
    due = any_store.now() + timedelta(hours=1)
    any_store.insert(new_delay("dup", due))
    with pytest.raises(StoreError):
        any_store.insert(new_delay("dup", due))
    assert any_store.cancel("dup")
    # retry() reuses its task id: a finished row is replaced by the new pending one.
    later = due + timedelta(hours=1)
    assert any_store.insert(new_delay("dup", later)).created
    row = any_store.get("dup")
    assert row is not None
    assert row.status == C.STATUS_PENDING
    assert row.due_at == later


def test_idempotency_key_unique_among_pending(any_store: DelayStore) -> None:
    due = any_store.now() + timedelta(hours=1)
    first = any_store.insert(new_delay("a", due, idempotency_key="k"))
    second = any_store.insert(new_delay("b", due, idempotency_key="k"))
    assert first.created
    assert not second.created
    assert second.task_id == "a"
    assert any_store.get("b") is None
    any_store.cancel("a")
    third = any_store.insert(new_delay("c", due, idempotency_key="k"))
    assert third.created
    assert third.task_id == "c"


def test_claim_due_orders_limits_and_respects_lookahead(any_store: DelayStore) -> None:
    now = any_store.now()
    any_store.insert(new_delay("late", now - timedelta(seconds=5)))
    any_store.insert(new_delay("later", now - timedelta(seconds=1)))
    any_store.insert(new_delay("latest", now - timedelta(seconds=10)))
    any_store.insert(new_delay("soon", now + timedelta(seconds=1)))
    any_store.insert(new_delay("future", now + timedelta(hours=1)))
    rows = any_store.claim_due(limit=2, lookahead=0, token="tok")
    assert [r.id for r in rows] == ["latest", "late"]
    assert all(r.status == C.STATUS_CLAIMED and r.claim_token == "tok" and r.attempts == 1 for r in rows)
    rows = any_store.claim_due(limit=10, lookahead=3, token="tok2")
    assert [r.id for r in rows] == ["later", "soon"]
    assert any_store.claim_due(limit=10, lookahead=3, token="tok3") == []
    assert any_store.counts()[C.STATUS_CLAIMED] == 4
    assert any_store.counts()[C.STATUS_PENDING] == 1


def test_pending_ahead_counts_pending_rows_due_by_the_horizon_up_to_a_limit(any_store: DelayStore) -> None:
    now = any_store.now().replace(microsecond=0)
    dues = {"overdue": -5, "soon": 1, "sooner": 2, "far": 60}
    for task_id, offset in dues.items():
        any_store.insert(new_delay(task_id, now + timedelta(seconds=offset)))
    any_store.insert(new_delay("gone", now))
    assert any_store.cancel("gone")
    assert any_store.pending_ahead(now + timedelta(seconds=10), 100) == (3, now + timedelta(seconds=2))
    assert any_store.pending_ahead(now + timedelta(seconds=10), 2) == (2, now + timedelta(seconds=1))
    assert any_store.pending_ahead(now - timedelta(seconds=60), 100) == (0, None)


def test_finish_states_need_the_claim_token(any_store: DelayStore) -> None:
    now = any_store.now()
    for i in range(4):
        any_store.insert(new_delay(f"r{i}", now - timedelta(seconds=1)))
    rows = any_store.claim_due(limit=10, lookahead=0, token="mine")
    assert len(rows) == 4
    assert any_store.mark_sent(["r0"], "other") == 0
    assert any_store.mark_sent(["r0"], "mine") == 1
    assert any_store.mark_sent(["r0"], "mine") == 0
    assert any_store.mark_expired(["r1"], "mine") == 1
    assert any_store.mark_failed("r2", "mine", "LookupError: unknown task " + "x" * 10_000)
    assert any_store.release(["r3"], "mine") == 1
    by_id = {r: any_store.get(r) for r in ("r0", "r1", "r2", "r3")}
    assert by_id["r0"] is not None
    assert by_id["r0"].status == C.STATUS_SENT
    assert by_id["r0"].sent_at is not None
    assert by_id["r1"] is not None
    assert by_id["r1"].status == C.STATUS_EXPIRED
    failed = by_id["r2"]
    assert failed is not None
    assert failed.status == C.STATUS_FAILED
    assert failed.last_error is not None
    assert failed.last_error.startswith("LookupError: unknown task")
    assert len(failed.last_error) <= C.DELAY_ERROR_LENGTH
    assert by_id["r3"] is not None
    assert by_id["r3"].status == C.STATUS_PENDING


def test_reclaim_stale_claims(any_store: DelayStore) -> None:
    now = any_store.now()
    any_store.insert(new_delay("s", now - timedelta(seconds=1)))
    assert len(any_store.claim_due(limit=10, lookahead=0, token="dead")) == 1
    assert any_store.reclaim_stale(60) == 0
    time.sleep(0.3)
    assert any_store.reclaim_stale(0.1) == 1
    row = any_store.get("s")
    assert row is not None
    assert row.status == C.STATUS_PENDING
    assert row.claim_token is None
    # The dead sweeper's token no longer finishes it; a new claim does.
    assert any_store.mark_sent(["s"], "dead") == 0
    again = any_store.claim_due(limit=10, lookahead=0, token="alive")
    assert [r.attempts for r in again] == [2]


def test_cancel_and_reschedule_return_whether_an_unstarted_row_changed(any_store: DelayStore) -> None:
    now = any_store.now()
    any_store.insert(new_delay("c", now + timedelta(hours=1)))
    any_store.insert(new_delay("m", now + timedelta(hours=1)))
    assert any_store.reschedule("m", now + timedelta(hours=3))
    assert any_store.reschedule("m", now - timedelta(seconds=1))
    assert any_store.cancel("c")
    assert not any_store.cancel("c")
    assert not any_store.reschedule("c", now)
    assert not any_store.cancel("nope")
    [claimed] = any_store.claim_due(limit=10, lookahead=0, token="t")
    assert claimed.id == "m"
    # A claimed row may already be on its way to the broker: cancelling it still stops the run
    # (the delivery check drops the message), and the sweep's mark_sent no longer touches it.
    assert any_store.cancel("m")
    assert any_store.mark_sent(["m"], "t") == 0
    row = any_store.get("m")
    assert row is not None
    assert row.status == C.STATUS_CANCELLED
    assert row.claim_token is None


def test_rerun_sends_a_failed_or_expired_row_back_to_pending_due_now_once(any_store: DelayStore) -> None:
    now = any_store.now()
    expired_at = now - timedelta(seconds=1)
    any_store.insert(new_delay("f", now - timedelta(seconds=2), idempotency_key="k"))
    any_store.insert(new_delay("x", now - timedelta(seconds=1), expires_at=expired_at))
    any_store.insert(new_delay("p", now + timedelta(hours=1)))
    claimed = {row.id: row for row in any_store.claim_due(limit=10, lookahead=0, token="t")}
    assert set(claimed) == {"f", "x"}
    assert any_store.mark_failed("f", "t", "NotRegistered: tests.delays.record")
    assert any_store.mark_expired(["x"], "t") == 1
    # A later call holds the failed row's key: the rerun row gives it up rather than clash.
    assert any_store.insert(new_delay("f2", now + timedelta(hours=1), idempotency_key="k")).created
    assert not any_store.rerun("p")  # pending: not rerunnable
    assert not any_store.rerun("nope")
    assert any_store.rerun("f")
    assert any_store.rerun("x")
    assert not any_store.rerun("f")  # pending again: a second rerun changes nothing
    for task_id in ("f", "x"):
        row = any_store.get(task_id)
        assert row is not None
        assert row.status == C.STATUS_PENDING
        assert row.expires_at is None
        assert row.claim_token is None
        assert row.delivery_token != claimed[task_id].delivery_token
        assert abs((row.due_at - any_store.now()).total_seconds()) < 5
    again = any_store.claim_due(limit=10, lookahead=0, token="t2")
    assert sorted(row.id for row in again) == ["f", "x"]
    assert any_store.claim_due(limit=10, lookahead=0, token="t3") == []


def _started(store: DelayStore, task_id: str, run_id: str = "run-1") -> str:
    """Insert ``task_id`` due now, claim and start it; returns its delivery token."""
    store.insert(new_delay(task_id, store.now() - timedelta(seconds=1)))
    [row] = [r for r in store.claim_due(limit=50, lookahead=0, token="claim") if r.id == task_id]
    assert row.delivery_token
    assert store.start(task_id, row.delivery_token, run_id, "host-a", stale_after=60).verdict == "run"
    return row.delivery_token


def test_each_insert_and_reschedule_gets_a_new_delivery_token(any_store: DelayStore) -> None:
    now = any_store.now()
    any_store.insert(new_delay("tok", now + timedelta(hours=1)))
    first = any_store.get("tok")
    assert first is not None
    assert first.delivery_token
    assert any_store.reschedule("tok", now + timedelta(hours=2))
    second = any_store.get("tok")
    assert second is not None
    assert second.delivery_token not in (None, first.delivery_token)
    assert any_store.cancel("tok")
    any_store.insert(new_delay("tok", now + timedelta(hours=3)))
    third = any_store.get("tok")
    assert third is not None
    assert third.delivery_token not in (first.delivery_token, second.delivery_token)


def test_the_conditional_start_lets_one_copy_of_a_delivery_run(any_store: DelayStore) -> None:
    token = _started(any_store, "once")
    row = any_store.get("once")
    assert row is not None
    assert (row.status, row.worker, row.started_by, row.starts) == (C.STATUS_STARTED, "host-a", "run-1", 1)
    assert row.started_at is not None
    assert row.heartbeat_at is not None
    # A redelivered copy while the first run's heartbeat is fresh: re-queue, never run beside it.
    again = any_store.start("once", token, "run-2", "host-b", stale_after=60)
    assert again.verdict == "running"
    assert again.row is not None
    assert again.row.worker == "host-a"
    # A stale message (another token: the row was rescheduled or replaced meanwhile).
    assert any_store.start("once", "other-token", "run-3", "host-b", stale_after=60).verdict == "superseded"
    assert any_store.start("gone", token, "run-4", "host-b", stale_after=60).verdict == "missing"
    assert any_store.heartbeat("once", token, "run-1")
    assert not any_store.heartbeat("once", token, "run-2")
    assert any_store.finish("once", token, "run-1", C.OUTCOME_SUCCEEDED)
    assert not any_store.finish("once", token, "run-1", C.OUTCOME_SUCCEEDED)
    done = any_store.get("once")
    assert done is not None
    assert (done.status, done.outcome) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED)
    assert done.finished_at is not None
    assert any_store.start("once", token, "run-5", "host-b", stale_after=60).verdict == "done"


def test_a_run_that_hands_its_message_back_leaves_the_row_to_that_message(any_store: DelayStore) -> None:
    token = _started(any_store, "back")
    assert not any_store.hand_back("back", token, "run-2")  # not the run that holds the row
    assert any_store.hand_back("back", token, "run-1")
    row = any_store.get("back")
    assert row is not None
    assert (row.status, row.outcome) == (C.STATUS_SENT, None)
    assert not any_store.hand_back("back", token, "run-1")  # no longer started
    # The same message, back from the broker, starts it again at once.
    assert any_store.start("back", token, "run-3", "host-b", stale_after=60).verdict == "run"
    row = any_store.get("back")
    assert row is not None
    assert (row.status, row.started_by, row.starts) == (C.STATUS_STARTED, "run-3", 2)


def test_a_start_before_the_row_is_due_by_the_stores_clock_is_early(any_store: DelayStore) -> None:
    any_store.insert(new_delay("ahead", any_store.now() + timedelta(seconds=30)))
    [row] = [r for r in any_store.claim_due(limit=50, lookahead=60, token="claim") if r.id == "ahead"]
    assert row.delivery_token
    early = any_store.start("ahead", row.delivery_token, "run-1", "w", stale_after=60, leeway=0.1)
    assert early.verdict == "early"
    assert 25 < early.early_by <= 30
    claimed = any_store.get("ahead")
    assert claimed is not None
    assert claimed.status == C.STATUS_CLAIMED  # untouched
    # Within the leeway (or without one) it starts.
    assert any_store.start("ahead", row.delivery_token, "run-2", "w", stale_after=60, leeway=40).verdict == "run"


def test_a_start_whose_heartbeat_stopped_is_taken_over(any_store: DelayStore) -> None:
    token = _started(any_store, "dead")
    time.sleep(0.3)
    assert any_store.start("dead", token, "run-2", "host-b", stale_after=60).verdict == "running"
    # The first look at a stale heartbeat only suspects it (after a store outage every heartbeat is
    # stale at once); it must stay stale for stale_after more before a copy takes over.
    first_look = any_store.start("dead", token, "run-2", "host-b", stale_after=0.1)
    assert first_look.verdict == "running"
    assert first_look.row is not None
    assert first_look.row.suspected_at is not None
    time.sleep(0.3)
    taken = any_store.start("dead", token, "run-2", "host-b", stale_after=0.1)
    assert taken.verdict == "run"
    row = any_store.get("dead")
    assert row is not None
    assert (row.worker, row.started_by, row.starts) == ("host-b", "run-2", 2)
    # The dead run can no longer write: its heartbeat and end belong to the run that took over.
    assert not any_store.heartbeat("dead", token, "run-1")
    assert not any_store.finish("dead", token, "run-1", C.OUTCOME_SUCCEEDED)


def test_a_heartbeat_after_the_suspicion_clears_it(any_store: DelayStore) -> None:
    token = _started(any_store, "alive")
    time.sleep(0.3)
    assert any_store.start("alive", token, "copy", "h", stale_after=0.1).verdict == "running"  # suspected
    assert any_store.heartbeat("alive", token, "run-1")  # the run was only cut off (a store outage)
    time.sleep(1.6)
    # Stale again, but not since the suspicion: a new suspicion, no takeover. The end_stale window
    # (1.5 s) is shorter than the heartbeat's age and longer than the new suspicion's, with 1.5 s to
    # spare for a loaded machine between the two calls (a 0.1 s window failed at load 20).
    assert any_store.start("alive", token, "copy", "h", stale_after=0.1).verdict == "running"
    assert not any_store.end_stale("alive", token, 1.5, rerun=True)
    row = any_store.get("alive")
    assert row is not None
    assert (row.status, row.started_by) == (C.STATUS_STARTED, "run-1")


def test_a_suspicion_not_looked_at_for_a_while_starts_over(any_store: DelayStore) -> None:
    token = _started(any_store, "cut")
    time.sleep(0.3)
    assert not any_store.end_stale("cut", token, 0.1, rerun=True, looked_within=2.0)  # suspected
    first = any_store.get("cut")
    assert first is not None
    assert first.suspected_at is not None
    # No look for longer than looked_within (the store was unreachable): suspected anew, not taken over.
    time.sleep(2.3)
    assert not any_store.end_stale("cut", token, 0.1, rerun=True, looked_within=2.0)
    again = any_store.get("cut")
    assert again is not None
    assert again.status == C.STATUS_STARTED
    assert again.suspected_at is not None
    assert again.suspected_at > first.suspected_at
    # Looked at again within the window (1.7 s to spare for a loaded machine), silent since: taken over.
    time.sleep(0.3)
    assert any_store.end_stale("cut", token, 0.1, rerun=True, looked_within=2.0)
    taken = any_store.get("cut")
    assert taken is not None
    assert taken.status == C.STATUS_PENDING


def test_a_start_whose_reply_was_lost_is_recognised_by_its_run_id(any_store: DelayStore) -> None:
    token = _started(any_store, "lost", run_id="first-run")
    assert any_store.start("lost", token, "copy", "h", stale_after=60).verdict == "running"
    assert any_store.start("lost", token, "copy", "h", stale_after=60, prior_runs=["first-run"]).verdict == "run"


def test_failed_outcome_keeps_the_error(any_store: DelayStore) -> None:
    token = _started(any_store, "boom")
    assert any_store.finish("boom", token, "run-1", C.OUTCOME_FAILED, "ValueError: " + "x" * 5000)
    row = any_store.get("boom")
    assert row is not None
    assert row.outcome == C.OUTCOME_FAILED
    assert row.last_error is not None
    assert row.last_error.startswith("ValueError: xxx")
    assert len(row.last_error) <= C.DELAY_ERROR_LENGTH


def test_a_running_row_is_replaced_by_its_own_retry(any_store: DelayStore) -> None:
    token = _started(any_store, "retrying")
    later = any_store.now() + timedelta(hours=1)
    assert any_store.insert(new_delay("retrying", later)).created
    row = any_store.get("retrying")
    assert row is not None
    assert row.status == C.STATUS_PENDING
    assert row.delivery_token != token
    assert not any_store.finish("retrying", token, "run-1", C.OUTCOME_RETRIED)  # the old run's end is moot


def test_a_row_published_again_waits_twice_as_long_before_its_next_copy(any_store: DelayStore) -> None:
    # A row whose message sits behind a backlog looks lost too: each further copy waits twice as long.
    grace = 0.3
    any_store.insert(new_delay("backlogged", any_store.now() - timedelta(seconds=1)))
    waits = []
    for claim in ("c1", "c2", "c3"):
        (row,) = any_store.claim_due(limit=10, lookahead=0, token=claim)
        assert any_store.mark_sent(["backlogged"], claim) == 1
        sent = time.monotonic()
        while not any_store.requeue_unstarted(grace=grace):
            assert time.monotonic() - sent < 30, f"copy {row.attempts} never published again"
            time.sleep(0.02)
        waits.append(time.monotonic() - sent)
    # The store republishes only once its own clock has passed the wait; the test's clock started
    # before the row was marked sent, so each measured wait is that long but for the stores'
    # timestamp resolution and the two clocks' drift (SQLite's, milliseconds: 0.297 s for 0.3).
    slack = 0.05
    assert waits[0] >= grace - slack
    assert waits[1] >= 2 * grace - slack
    assert waits[2] >= 4 * grace - slack
    row = any_store.get("backlogged")
    assert row is not None
    assert (row.status, row.attempts) == (C.STATUS_PENDING, 3)


def test_delivery_confirmation_requeues_unstarted_and_ends_stale_rows(any_store: DelayStore) -> None:
    any_store.insert(new_delay("unstarted", any_store.now() - timedelta(seconds=1)))
    any_store.claim_due(limit=10, lookahead=0, token="c1")
    assert any_store.mark_sent(["unstarted"], "c1") == 1
    assert any_store.requeue_unstarted(grace=60) == 0
    time.sleep(0.3)
    assert any_store.requeue_unstarted(grace=0.1) == 1
    row = any_store.get("unstarted")
    assert row is not None
    assert row.status == C.STATUS_PENDING
    token = row.delivery_token
    assert [r.delivery_token for r in any_store.claim_due(limit=10, lookahead=0, token="c2")] == [token]

    stale_token = _started(any_store, "stale")
    interrupted_token = _started(any_store, "interrupted")
    assert any_store.stale_started(60, limit=10) == []
    time.sleep(0.3)
    assert {r.id for r in any_store.stale_started(0.1, limit=10)} == {"stale", "interrupted"}
    assert not any_store.end_stale("stale", "wrong-token", 0.1, rerun=True)
    assert not any_store.end_stale("stale", stale_token, 0.1, rerun=True)  # suspected only
    assert not any_store.end_stale("interrupted", interrupted_token, 0.1, rerun=False)
    time.sleep(0.3)
    assert any_store.end_stale("stale", stale_token, 0.1, rerun=True)
    assert any_store.end_stale("interrupted", interrupted_token, 0.1, rerun=False)
    stale, interrupted = any_store.get("stale"), any_store.get("interrupted")
    assert stale is not None
    assert (stale.status, stale.delivery_token) == (C.STATUS_PENDING, stale_token)
    assert interrupted is not None
    assert (interrupted.status, interrupted.outcome) == (C.STATUS_FINISHED, C.OUTCOME_INTERRUPTED)


def test_a_sent_row_past_its_expiry_is_closed_once(any_store: DelayStore) -> None:
    now = any_store.now()
    # Published, then its expiry passed (the sweep claims by due time only; no clock race to wait out).
    any_store.insert(new_delay("past", now - timedelta(seconds=2), expires_at=now - timedelta(seconds=1)))
    any_store.insert(new_delay("later", now - timedelta(seconds=1), expires_at=now + timedelta(hours=1)))
    any_store.insert(new_delay("never", now - timedelta(seconds=1)))
    any_store.insert(new_delay("pending", now + timedelta(hours=1), expires_at=now - timedelta(seconds=1)))
    any_store.claim_due(limit=10, lookahead=0, token="c1")
    assert any_store.mark_sent(["past", "later", "never"], "c1") == 3
    [found] = any_store.expired_unstarted(limit=10)  # only sent rows: a pending one is the claim's
    assert found.id == "past"
    assert found.delivery_token is not None
    assert not any_store.end_expired("past", "wrong-token")
    assert not any_store.end_expired("later", any_store.get("later").delivery_token or "")  # type: ignore[union-attr]
    assert any_store.end_expired("past", found.delivery_token)
    assert not any_store.end_expired("past", found.delivery_token)  # closed once, whoever asks again
    row = any_store.get("past")
    assert row is not None
    assert row.status == C.STATUS_EXPIRED
    assert any_store.expired_unstarted(limit=10) == []


def test_list_counts_and_oldest_due(any_store: DelayStore) -> None:
    now = any_store.now()
    assert any_store.oldest_due() is None
    assert set(any_store.counts()) == set(C.DELAY_STATUSES)
    for i in range(5):
        any_store.insert(new_delay(f"l{i}", now + timedelta(minutes=i), task="a" if i % 2 else "b"))
    any_store.cancel("l0")
    assert any_store.oldest_due() == now + timedelta(minutes=1)
    assert [r.id for r in any_store.list()] == ["l0", "l1", "l2", "l3", "l4"]
    assert [r.id for r in any_store.list(status=C.STATUS_PENDING, task="a")] == ["l1", "l3"]
    assert [r.id for r in any_store.list(due_before=now + timedelta(minutes=2), limit=2)] == ["l0", "l1"]
    counts = any_store.counts()
    assert counts[C.STATUS_PENDING] == 4
    assert counts[C.STATUS_CANCELLED] == 1
    summary = any_store.list(limit=1)[0].summary()
    assert "payload" not in summary
    assert summary["payload_bytes"] > 0


def test_concurrent_claims_never_hand_out_a_row_twice(any_store: DelayStore) -> None:
    now = any_store.now()
    if hasattr(any_store, "bulk_insert"):
        any_store.bulk_insert([new_delay(f"c{i:04d}", now - timedelta(seconds=1)) for i in range(600)])
    else:
        for i in range(600):
            any_store.insert(new_delay(f"c{i:04d}", now - timedelta(seconds=1)))
    seen: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer(n: int) -> None:
        try:
            while True:
                rows = any_store.claim_due(limit=25, lookahead=0, token=f"w{n}")
                if not rows:
                    return
                with lock:
                    seen.extend(r.id for r in rows)
                any_store.mark_sent([r.id for r in rows], f"w{n}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            if hasattr(any_store, "using"):  # Django: each thread opened its own connection
                from django.db import connections

                connections.close_all()

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(seen) == 600
    assert len(set(seen)) == 600
    assert any_store.counts()[C.STATUS_SENT] == 600


# --- purge ------------------------------------------------------------------------------------


def _rows_in(store: DelayStore, prefix: str) -> set[str]:
    """One row per status, ids ``<prefix>-<status>``: sent, cancelled, expired, failed, claimed, pending."""
    past = store.now() - timedelta(seconds=1)
    for status in ("sent", "expired", "failed", "claimed"):
        store.insert(new_delay(f"{prefix}-{status}", past))
    token = f"{prefix}-token"
    assert len(store.claim_due(limit=10, lookahead=0, token=token)) == 4
    assert store.mark_sent([f"{prefix}-sent"], token) == 1
    assert store.mark_expired([f"{prefix}-expired"], token) == 1
    assert store.mark_failed(f"{prefix}-failed", token, "boom")
    store.insert(new_delay(f"{prefix}-cancelled", past + timedelta(hours=1)))
    assert store.cancel(f"{prefix}-cancelled")
    store.insert(new_delay(f"{prefix}-pending", past + timedelta(hours=1)))
    return {f"{prefix}-{s}" for s in ("sent", "expired", "failed", "claimed", "cancelled", "pending")}


def _cutoff(store: DelayStore) -> datetime:
    # Store clocks tick in milliseconds (SQLite): step past the stamps just written.
    time.sleep(0.02)
    cutoff = store.now()
    time.sleep(0.02)
    return cutoff


def _ids(store: DelayStore) -> set[str]:
    return {r.id for r in store.list(limit=1000)}


def test_purge_deletes_old_finished_rows_and_keeps_the_rest(any_store: DelayStore) -> None:
    _rows_in(any_store, "old")
    cutoff = _cutoff(any_store)
    new = _rows_in(any_store, "new")
    assert any_store.purgeable(cutoff) == 3
    assert any_store.purge(cutoff) == 3
    assert _ids(any_store) == {"old-failed", "old-claimed", "old-pending"} | new
    assert any_store.purge(cutoff) == 0
    # failed rows go only when asked for by name.
    assert any_store.purge(cutoff, statuses=[C.STATUS_FAILED]) == 1
    assert any_store.get("old-failed") is None
    # A cutoff in the future takes the recent finished rows too, never pending or claimed ones.
    later = any_store.now() + timedelta(hours=1)
    assert any_store.purge(later, statuses=C.PURGEABLE_STATUSES) == 4
    assert _ids(any_store) == {"old-claimed", "old-pending", "new-claimed", "new-pending"}
    counts = any_store.counts()
    assert counts[C.STATUS_PENDING] == 2
    assert counts[C.STATUS_CLAIMED] == 2
    assert sum(counts.values()) == 4


def test_purge_respects_its_limit(any_store: DelayStore) -> None:
    past = any_store.now() - timedelta(seconds=1)
    for i in range(7):
        any_store.insert(new_delay(f"p{i}", past))
    assert len(any_store.claim_due(limit=10, lookahead=0, token="t")) == 7
    assert any_store.mark_sent([f"p{i}" for i in range(7)], "t") == 7
    cutoff = _cutoff(any_store)
    assert any_store.purgeable(cutoff, statuses={C.STATUS_SENT}) == 7
    assert [any_store.purge(cutoff, limit=3) for _ in range(4)] == [3, 3, 1, 0]
    assert any_store.counts()[C.STATUS_SENT] == 0
    assert any_store.purgeable(cutoff) == 0


def test_purge_a_reused_task_id_keeps_the_new_pending_row(any_store: DelayStore) -> None:
    any_store.insert(new_delay("again", any_store.now() + timedelta(hours=1)))
    assert any_store.cancel("again")
    cutoff = _cutoff(any_store)
    # retry() reuses the id: the old finished row is replaced by a pending one, which must stay.
    any_store.insert(new_delay("again", any_store.now() + timedelta(hours=2)))
    assert any_store.purge(cutoff) == 0
    assert any_store.purge(any_store.now() + timedelta(hours=1)) == 0
    row = any_store.get("again")
    assert row is not None
    assert row.status == C.STATUS_PENDING


@pytest.mark.parametrize(
    ("statuses", "limit", "naive"),
    [
        ([C.STATUS_PENDING], 10, False),
        ([C.STATUS_SENT, C.STATUS_CLAIMED], 10, False),
        (C.STATUS_PENDING, 10, False),
        (["nonsense"], 10, False),
        ([C.STATUS_SENT], 0, False),
        ([C.STATUS_SENT], 10, True),
    ],
    ids=["pending", "claimed", "bare-string", "unknown", "zero-limit", "naive"],
)
def test_purge_refuses_unfinished_rows_and_bad_arguments(
    any_store: DelayStore, statuses: Any, limit: int, naive: bool
) -> None:
    any_store.insert(new_delay("keep", any_store.now() - timedelta(seconds=1)))
    before = any_store.now() + timedelta(hours=1)
    with pytest.raises(ValueError) as info:
        any_store.purge(before.replace(tzinfo=None) if naive else before, statuses, limit)
    assert isinstance(info.value, PurgeRefused)
    assert any_store.get("keep") is not None
    assert any_store.purge(before, []) == 0


def _in_namespace(store: DelayStore, namespace: str) -> DelayStore:
    """Another app's view of the same table (same connection pool / rows), scoped to ``namespace``."""
    import copy

    scoped = copy.copy(store)
    scoped.namespace = namespace
    return scoped


def test_namespaces_split_one_table_and_legacy_rows_stay_everyones(any_store: DelayStore) -> None:
    a, b = _in_namespace(any_store, "billing"), _in_namespace(any_store, "shop")
    now = any_store.now()
    a.insert(new_delay("a1", now - timedelta(seconds=3), idempotency_key="k"))
    b.insert(new_delay("b1", now - timedelta(seconds=2)))
    any_store.insert(new_delay("old", now - timedelta(seconds=1)))  # no namespace: stored before namespaces

    assert a.get("b1") is None
    assert b.get("a1") is None
    assert (a.get("a1").namespace, b.get("b1").namespace, a.get("old").namespace) == ("billing", "shop", "")  # type: ignore[union-attr]
    assert [r.id for r in a.list()] == ["a1", "old"]
    assert [r.id for r in b.list()] == ["b1", "old"]
    assert [r.id for r in any_store.list()] == ["a1", "b1", "old"]
    assert a.counts()[C.STATUS_PENDING] == 2
    assert a.oldest_due() == now - timedelta(seconds=3)
    assert b.oldest_due() == now - timedelta(seconds=2)
    assert not b.cancel("a1")
    assert not b.reschedule("a1", now)
    # Another app's pending idempotency key is never answered with that app's row.
    try:
        other = b.insert(new_delay("b2", now + timedelta(hours=1), idempotency_key="k"))
    except StoreError:
        pass  # SQL stores: the key's unique index spans the table
    else:
        assert (other.task_id, other.created) == ("b2", True)

    assert [r.id for r in b.claim_due(limit=10, lookahead=0, token="tb")] == ["b1", "old"]
    assert [r.id for r in a.claim_due(limit=10, lookahead=0, token="ta")] == ["a1"]
    assert a.mark_sent(["a1"], "ta") == 1
    assert b.mark_sent(["b1", "old"], "tb") == 2
    later = any_store.now() + timedelta(seconds=1)
    assert b.purgeable(later) == 2
    assert a.purge(later) == 2  # a1 and the legacy row
    assert [r.id for r in any_store.list()] == ["b1", *(["b2"] if any_store.get("b2") else [])]


def test_insert_many_stores_a_batch_in_order_with_the_keys_of_single_inserts(any_store: DelayStore) -> None:
    now = any_store.now()
    held = any_store.insert(new_delay("held", now + timedelta(hours=1), idempotency_key="k-held"))
    batch = [
        new_delay("b0", now + timedelta(hours=2)),
        new_delay("b1", now + timedelta(hours=2), idempotency_key="k-held"),  # held by a pending row
        new_delay("b2", now + timedelta(hours=3), idempotency_key="k-new"),
        new_delay("b3", now + timedelta(hours=4), idempotency_key="k-new"),  # held by b2, same batch
        new_delay("b4", now + timedelta(hours=5)),
    ]
    results = any_store.insert_many(batch)
    assert [(r.task_id, r.created) for r in results] == [
        ("b0", True),
        (held.task_id, False),
        ("b2", True),
        ("b2", False),
        ("b4", True),
    ]
    assert results[3].due_at == results[2].due_at
    assert any_store.counts()[C.STATUS_PENDING] == 4
    assert any_store.get("b1") is None
    assert any_store.get("b3") is None
    row = any_store.get("b2")
    assert row is not None
    assert row.idempotency_key == "k-new"
    assert row.delivery_token
    assert any_store.insert_many([]) == []


def test_insert_many_is_all_or_nothing_and_names_the_refused_delay(any_store: DelayStore) -> None:
    now = any_store.now()
    any_store.insert(new_delay("taken", now + timedelta(hours=1)))
    finished = any_store.insert(new_delay("done", now - timedelta(seconds=1)))
    [claimed] = any_store.claim_due(limit=1, lookahead=0, token="t")
    assert claimed.id == finished.task_id
    assert any_store.mark_sent([claimed.id], "t") == 1
    batch = [new_delay(f"ok-{i}", now + timedelta(hours=2)) for i in range(3)]
    with pytest.raises(StoreError, match="already stored") as failed:
        any_store.insert_many([*batch, new_delay("taken", now + timedelta(hours=2))])
    assert failed.value.index == 3
    with pytest.raises(StoreError) as twice:
        any_store.insert_many([new_delay("dup", now + timedelta(hours=2)), new_delay("dup", now + timedelta(hours=3))])
    assert twice.value.index == 1
    assert {r.id for r in any_store.list(limit=100)} == {"taken", "done"}
    # A finished task id is replaced, as by insert (retry() reuses task ids).
    results = any_store.insert_many([*batch, new_delay("done", now + timedelta(hours=2))])
    assert all(r.created for r in results)
    done = any_store.get("done")
    assert done is not None
    assert done.status == C.STATUS_PENDING


def test_an_end_that_need_not_wait_for_the_disk_is_recorded_the_same(any_store: DelayStore) -> None:
    token = _started(any_store, "relaxed")
    assert any_store.heartbeat("relaxed", token, "run-1")
    assert any_store.finish("relaxed", token, "run-1", C.OUTCOME_SUCCEEDED, durable=False)
    assert not any_store.finish("relaxed", token, "run-1", C.OUTCOME_SUCCEEDED, durable=False)
    done = any_store.get("relaxed")
    assert done is not None
    assert (done.status, done.outcome) == (C.STATUS_FINISHED, C.OUTCOME_SUCCEEDED)
    if isinstance(any_store, SQLAlchemyStore) and any_store.dialect == "postgresql":
        # PostgreSQL: those writes went through connections that do not wait for the WAL flush.
        assert any_store._record_writes is not None
        with any_store._record_writes.engines[False].connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar_one() == "off"


def test_postgres_delivery_writes_survive_cut_connections_and_a_start_sent_twice(postgres_url: str) -> None:
    """PostgreSQL sends the start, heartbeat and end on pooled connections without a pre-ping: one the
    server closed is replaced and the statement sent again, and a start sent again by its own run (its
    reply was lost) wins again and counts once."""
    store = fresh_sql_store(postgres_url)
    try:
        token = _started(store, "cut")
        assert store.heartbeat("cut", token, "run-1")
        # The server closes every other connection to this session's database (a restart, an idle timeout).
        with store.engine.connect() as conn:
            cut = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        assert cut >= 2  # the durable and the unflushed pool's connections
        assert store.heartbeat("cut", token, "run-1")
        assert store.start("cut", token, "run-1", "host-a", stale_after=60).verdict == "run"
        assert store.start("cut", token, "run-2", "host-b", stale_after=60).verdict == "running"
        row = store.get("cut")
        assert row is not None
        assert (row.status, row.started_by, row.starts) == (C.STATUS_STARTED, "run-1", 1)
        assert store.finish("cut", token, "run-1", C.OUTCOME_SUCCEEDED)
        assert store.start("cut", token, "run-1", "host-a", stale_after=60).verdict == "done"
    finally:
        store.close()
