"""One contract for every delayed-task store: memory, SQLAlchemy (SQLite, PostgreSQL), Django ORM."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from celery_safe_time import constants as C
from celery_safe_time.exceptions import StoreError
from celery_safe_time.stores.base import DelayStore
from tests.helpers.delays import new_delay

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


def test_cancel_and_reschedule_return_whether_a_pending_row_changed(any_store: DelayStore) -> None:
    now = any_store.now()
    any_store.insert(new_delay("c", now + timedelta(hours=1)))
    any_store.insert(new_delay("m", now + timedelta(hours=1)))
    assert any_store.reschedule("m", now + timedelta(hours=3))
    assert any_store.reschedule("m", now - timedelta(seconds=1))
    assert any_store.cancel("c")
    assert not any_store.cancel("c")
    assert not any_store.reschedule("c", now)
    assert not any_store.cancel("nope")
    assert [r.id for r in any_store.claim_due(limit=10, lookahead=0, token="t")] == ["m"]
    assert not any_store.cancel("m")  # claimed, not pending


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
