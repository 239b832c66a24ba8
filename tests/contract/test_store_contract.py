"""One contract for every delayed-task store: memory, SQLAlchemy (SQLite, PostgreSQL), Django ORM."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_safe_time import constants as C
from celery_safe_time.delays.stores.base import DelayStore
from celery_safe_time.exceptions import PurgeRefused, StoreError
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
