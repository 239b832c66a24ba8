"""Debounced rows in every store: one pending row per key, moved and replaced in place, capped, atomic."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta
from typing import Any

import pytest

from celery_safe_time import constants as C
from celery_safe_time.delays.backends.base import DelayStore, NewDelay
from tests.helpers.delays import new_delay

pytestmark = pytest.mark.integration

KEY = C.DEBOUNCE_KEY_PREFIX + "tests.delays.record:index:1"


def debounced(
    task_id: str, payload: bytes, *, period: float = 60.0, max_wait: float | None = 300.0, **extra: Any
) -> NewDelay:
    delay = new_delay(task_id, None, payload=payload, idempotency_key=extra.pop("key", KEY), **extra)  # type: ignore[arg-type]
    return dataclasses.replace(delay, countdown=period, debounce_max_wait=max_wait)


def _close_thread_connection(store: DelayStore) -> None:
    if hasattr(store, "using"):  # Django: each thread opened its own connection
        from django.db import connections

        connections.close_all()


def test_a_later_call_moves_the_pending_row_and_replaces_its_arguments(any_store: DelayStore) -> None:
    before = any_store.now()
    first = any_store.debounce(debounced("d1", b"first"))
    assert first.created
    assert first.task_id == "d1"
    row = any_store.get("d1")
    assert row is not None
    assert row.debounce_key == "tests.delays.record:index:1"
    assert row.debounce_until is not None
    assert timedelta(seconds=299) < row.debounce_until - before < timedelta(seconds=301)
    assert timedelta(seconds=59) < row.due_at - before < timedelta(seconds=61)
    token = row.delivery_token

    second = any_store.debounce(debounced("d2", b"second", period=120.0))
    assert not second.created
    assert second.task_id == "d1"
    assert any_store.get("d2") is None
    moved = any_store.get("d1")
    assert moved is not None
    assert moved.payload == b"second"
    assert moved.due_at == second.due_at
    assert moved.due_at > row.due_at + timedelta(seconds=50)
    assert moved.debounce_until == row.debounce_until  # the cap counts from the burst's first call
    assert moved.delivery_token != token  # a copy published with the old arguments is superseded
    assert moved.status == C.STATUS_PENDING
    assert any_store.counts()[C.STATUS_PENDING] == 1


def test_a_burst_never_moves_past_the_first_call_plus_the_max_wait(any_store: DelayStore) -> None:
    any_store.debounce(debounced("cap", b"1", period=60.0, max_wait=90.0))
    row = any_store.get("cap")
    assert row is not None
    assert row.debounce_until is not None
    later = any_store.debounce(debounced("cap2", b"2", period=600.0))
    assert later.due_at == row.debounce_until
    capped = any_store.get("cap")
    assert capped is not None
    assert capped.due_at == row.debounce_until
    assert capped.payload == b"2"


def test_without_a_max_wait_every_call_pushes_the_row_back(any_store: DelayStore) -> None:
    any_store.debounce(debounced("nocap", b"1", period=60.0, max_wait=None))
    later = any_store.debounce(debounced("nocap2", b"2", period=6000.0, max_wait=None))
    row = any_store.get("nocap")
    assert row is not None
    assert row.debounce_until is None
    assert later.due_at == row.due_at
    assert row.due_at - any_store.now() > timedelta(seconds=5000)


def test_keys_are_independent_and_apart_from_idempotency_keys(any_store: DelayStore) -> None:
    any_store.debounce(debounced("k1", b"1", key=KEY + "a"))
    any_store.debounce(debounced("k2", b"2", key=KEY + "b"))
    plain = any_store.insert(new_delay("plain", any_store.now() + timedelta(hours=1), idempotency_key="index:1"))
    assert plain.created
    assert any_store.counts()[C.STATUS_PENDING] == 3
    row = any_store.get("plain")
    assert row is not None
    assert row.debounce_key is None
    # The operator view counts pending bursts only (not plain rows, not a claimed burst).
    assert any_store.pending_debounced() == 2
    any_store.claim_due(limit=10, lookahead=3600, token="sweep")
    assert any_store.pending_debounced() == 0


def test_a_claimed_row_starts_a_new_burst(any_store: DelayStore) -> None:
    any_store.debounce(debounced("old", b"old"))
    [claimed] = any_store.claim_due(limit=10, lookahead=3600, token="sweep")
    assert claimed.id == "old"
    fresh = any_store.debounce(debounced("new", b"new"))
    assert fresh.created
    assert fresh.task_id == "new"
    assert any_store.mark_sent(["old"], "sweep") == 1
    again = any_store.debounce(debounced("newer", b"newer"))
    assert (again.created, again.task_id) == (False, "new")
    old = any_store.get("old")
    assert old is not None
    assert old.payload == b"old"  # the claimed row keeps what it was published with


def test_a_cancelled_debounced_row_is_not_moved_and_the_next_call_starts_over(any_store: DelayStore) -> None:
    any_store.debounce(debounced("c1", b"1"))
    assert any_store.cancel("c1")
    fresh = any_store.debounce(debounced("c2", b"2"))
    assert (fresh.created, fresh.task_id) == (True, "c2")
    cancelled = any_store.get("c1")
    assert cancelled is not None
    assert (cancelled.status, cancelled.payload) == (C.STATUS_CANCELLED, b"1")


def test_concurrent_callers_on_one_key_leave_one_row(any_store: DelayStore) -> None:
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def caller(n: int) -> None:
        try:
            start.wait()
            for i in range(30):
                for key in ("x", "y"):
                    result = any_store.debounce(debounced(f"t{n}-{i}-{key}", f"{n}-{i}".encode(), key=KEY + key))
                    with lock:
                        results.append(result)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            _close_thread_connection(any_store)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(results) == 360
    created = [r.task_id for r in results if r.created]
    assert len(created) == 2
    assert {r.task_id for r in results} == set(created)
    assert any_store.counts()[C.STATUS_PENDING] == 2


def test_a_row_the_sweep_claims_carries_the_last_call_that_merged_into_it(any_store: DelayStore) -> None:
    """Debounces racing claims: a call that merged into a row committed before the row was claimed."""
    calls = 120
    merged: dict[str, list[tuple[str, bytes]]] = {}
    claimed: dict[str, bytes] = {}
    errors: list[BaseException] = []
    done = threading.Event()
    lock = threading.Lock()

    def debouncer(key: str) -> None:
        try:
            for i in range(calls):
                payload = f"{key}-{i}".encode()
                # Due at once: every claim can take the row while the calls go on.
                delay = dataclasses.replace(debounced(f"{key}-{i}", payload, key=KEY + key), countdown=None)
                result = any_store.debounce(dataclasses.replace(delay, due_at=any_store.now() - timedelta(seconds=1)))
                with lock:
                    merged.setdefault(result.task_id, []).append((key, payload))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            _close_thread_connection(any_store)

    def claimer(n: int) -> None:
        try:
            while True:
                finished = done.is_set()
                rows = any_store.claim_due(limit=10, lookahead=0, token=f"sweep{n}")
                with lock:
                    claimed.update({r.id: r.payload for r in rows})
                any_store.mark_sent([r.id for r in rows], f"sweep{n}")
                if finished and not rows:
                    return
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            _close_thread_connection(any_store)

    debouncers = [threading.Thread(target=debouncer, args=(key,)) for key in ("p", "q", "r")]
    claimers = [threading.Thread(target=claimer, args=(n,)) for n in range(2)]
    for t in debouncers + claimers:
        t.start()
    for t in debouncers:
        t.join(120)
    done.set()
    for t in claimers:
        t.join(120)
    assert not errors
    assert set(claimed) == set(merged)
    for task_id, calls_of_row in merged.items():
        # One thread per key calls in order: the row went out with the last call that merged into it.
        assert claimed[task_id] == calls_of_row[-1][1], task_id
    assert sum(len(v) for v in merged.values()) == 3 * calls
