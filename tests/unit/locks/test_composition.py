"""Gates that compose (issue 38), on the memory backend, each delivery traced as a worker traces it.

The matrix is generated from :data:`GATES`: every pair, in both orders where the order is a choice
(a beat entry's run lease always wraps the task from outside; a stored delay, ``unique=`` and debounce
act at the publish, before any decorator), under every fault of :data:`FAULTS`.
A gate joins the matrix by joining the list. Whatever the stacking and the fault, each call's body
completes once, never beside a copy of itself, and no lock is left held.
(Real workers on Redis and PostgreSQL: tests/integration/locks/test_composition_worker.py.)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from celery import Task
from celery.app.trace import build_tracer
from celery.exceptions import Reject

from celery_safe_time import concurrency_limit, idempotent, overlap_lock, rate_limit
from celery_safe_time import constants as C
from celery_safe_time.exceptions import DebounceError
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.entry_runs import entry_key, wrap_task
from celery_safe_time.locks.limits import slot_key
from celery_safe_time.testing import SafeTimeTesting

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclasses.dataclass(frozen=True)
class Gate:
    """One gate of the matrix: a decorator on the body, or (``entry``) a beat entry's overlap policy,
    which the worker applies around the whole task from the message header."""

    name: str
    decorator: Callable[[], Decorator] | None = None
    entry: str | None = None
    #: ``SafeTask`` options of the task (``unique=``)
    task_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``apply_async`` options of each call (a countdown: the stored delay; debounce): the calls are
    #: published, stored in the test store, and run by ``run_due`` with the sweep's delivery record
    send_options: dict[str, Any] = dataclasses.field(default_factory=dict)


GATES = [
    Gate("entry_buffer_all", entry="buffer_all"),
    Gate("overlap_lock", lambda: overlap_lock("ol:{n}", ttl=60, retry_after=5)),
    Gate("concurrency_limit", lambda: concurrency_limit("cl", limit=2, ttl=60, retry_after=5)),
    Gate("rate_limit", lambda: rate_limit("rl", "1/10s")),
    Gate("idempotent", lambda: idempotent("idem:{n}", ttl=60, retry_after=5)),
    Gate("stored_delay", send_options={"countdown": 5}),
    Gate("unique", task_options={"unique": "u:{n}"}, send_options={"countdown": 1}),
    Gate("debounce", send_options={"debounce": 10, "debounce_key": "d:{n}"}),
]

#: Pairs refused at the call, with the error that names why.
REFUSED: dict[frozenset[str], type[Exception]] = {frozenset({"unique", "debounce"}): DebounceError}

#: none; the broker hands the message out again while it runs (acks_late past the visibility timeout);
#: the body calls retry() once; the body raises Reject(requeue=True) once (the broker delivers it again).
FAULTS = ["none", "redelivery", "retry", "reject_requeue"]


def _pairs() -> list[tuple[Gate, Gate]]:
    pairs: list[tuple[Gate, Gate]] = []
    for first, second in itertools.permutations(GATES, 2):
        if second.entry is not None or second.decorator is None:
            continue  # the entry's lease and the publish options are outermost whatever the decorators say
        pairs.append((first, second))
    publish = [g for g in GATES if g.decorator is None and g.entry is None]
    pairs += list(itertools.combinations(publish, 2))
    return pairs


CALLS = 4


class Runs:
    """What the bodies did: completed runs per call, and how many copies of a call ran at once."""

    def __init__(self) -> None:
        self.completed: dict[int, int] = {}
        self.running: dict[int, int] = {}
        self.most_at_once: dict[int, int] = {}
        self.faulted: set[int] = set()


def deliver_message(
    st: SafeTimeTesting,
    task: Task,
    args: tuple[Any, ...],
    *,
    task_id: str,
    attempt: str,
    headers: dict[str, Any] | None = None,
    redelivered: bool = False,
) -> str:
    """Trace one message of ``task`` as a worker does (not eager: re-queues go to the test store); a
    broker redelivery is the same message (``attempt``) with the ``redelivered`` flag. Returns the state."""
    message_headers = {C.HEADER_ATTEMPT: attempt, **(headers or {})}
    request: dict[str, Any] = {
        **message_headers,
        "id": task_id,
        "task": task.name,
        "args": list(args),
        "kwargs": {},
        "retries": 0,
        "is_eager": False,
        "hostname": "composition@test",
        "headers": message_headers,
        "root_id": task_id,
        "delivery_info": {"is_eager": False, "redelivered": redelivered},
    }
    tracer = build_tracer(task.name, task, eager=True, propagate=False, app=st.app)
    traced = tracer(task_id, list(args), {}, request)
    return traced.info.state if traced.info is not None else "SUCCESS"


def _make_task(st: SafeTimeTesting, name: str, gates: tuple[Gate, ...], fault: str, runs: Runs) -> Task:
    copies: list[Callable[[], None]] = []

    def body(self: Task, n: int) -> None:
        runs.running[n] = runs.running.get(n, 0) + 1
        runs.most_at_once[n] = max(runs.most_at_once.get(n, 0), runs.running[n])
        try:
            if n not in runs.faulted:
                runs.faulted.add(n)
                if fault == "retry":
                    raise self.retry(countdown=1)
                if fault == "reject_requeue":
                    task_id, headers = self.request.id, dict(self.request.headers or {})
                    copies.append(lambda: redeliver(task_id, headers, n))
                    raise Reject("again", requeue=True)
                if fault == "redelivery":
                    redeliver(self.request.id, self.request.headers, n)
            runs.completed[n] = runs.completed.get(n, 0) + 1
        finally:
            runs.running[n] -= 1

    def redeliver(task_id: str, headers: dict[str, Any] | None, n: int) -> None:
        deliver_message(
            st,
            task,
            (n,),
            task_id=task_id,
            attempt=str((headers or {}).get(C.HEADER_ATTEMPT)),
            headers={k: v for k, v in (headers or {}).items() if k != C.HEADER_ATTEMPT},
            redelivered=True,
        )

    wrapped: Callable[..., Any] = body
    for gate in reversed([g for g in gates if g.decorator is not None]):
        wrapped = gate.decorator()(wrapped)  # type: ignore[misc]  # the first gate in the list is outermost
    options = {k: v for g in gates for k, v in g.task_options.items()}
    task = st.app.task(name=name, bind=True, shared=False, acks_late=True, **options)(wrapped)
    if any(g.entry is not None for g in gates):
        wrap_task(task)
    task.pending_copies = copies
    return task


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(("outer", "inner"), _pairs(), ids=lambda g: g.name)
def test_stacked_gates_run_each_call_once(safe_time: SafeTimeTesting, outer: Gate, inner: Gate, fault: str) -> None:
    runs = Runs()
    task = _make_task(safe_time, f"compose.{outer.name}.{inner.name}.{fault}", (outer, inner), fault, runs)
    entry = outer.entry or inner.entry
    refused = REFUSED.get(frozenset({outer.name, inner.name}))
    if refused is not None:
        with pytest.raises(refused):
            task.apply_async((0,), **{**outer.send_options, **inner.send_options})
        return
    for n in range(CALLS):
        headers: dict[str, Any] = {}
        if entry is not None:
            headers[C.HEADER_OVERLAP] = {"entry": "compose", "policy": entry, "ttl": 60}
        send = {**outer.send_options, **inner.send_options}
        if send or outer.task_options or inner.task_options:
            if "debounce" in send:
                send.pop("countdown", None)  # a debounced call is stored: debounce gives its due time
            else:
                send.setdefault("countdown", 1)
            task.apply_async((n,), headers=headers, **send)
        else:
            deliver_message(safe_time, task, (n,), task_id=uuid.uuid4().hex, attempt=uuid.uuid4().hex, headers=headers)
        while task.pending_copies:
            task.pending_copies.pop(0)()
    for _ in range(20):
        safe_time.run_due(advance=timedelta(seconds=15), propagate=False)
        while task.pending_copies:
            task.pending_copies.pop(0)()
    assert runs.completed == dict.fromkeys(range(CALLS), 1)
    assert max(runs.most_at_once.values()) == 1  # a copy never runs beside its original
    assert safe_time.locks.scan() == []  # nothing held once every call ran


def test_a_redelivered_copy_finds_the_slot_its_original_holds(safe_time: SafeTimeTesting) -> None:
    """concurrency_limit(limit=2): the original holds the slot its copy does not try first, the other
    is free when the copy comes; the copy is a duplicate, never a second run beside the original."""
    attempt, task_id = "a-1", uuid.uuid4().hex
    home = slot_key("cl", zlib.crc32(attempt.encode()) % 2)
    blocker = Owner(task_id="blocker", identity="blocker", host="h", pid=1)
    assert safe_time.locks.acquire(home, "blocker-token", 60, blocker).status == "acquired"
    runs = Runs()

    @safe_time.app.task(name="compose.slot_copy", bind=True, shared=False, acks_late=True)
    @concurrency_limit("cl", limit=2, ttl=60, retry_after=5)
    def export(self: Task, n: int) -> None:
        runs.running[n] = runs.running.get(n, 0) + 1
        runs.most_at_once[n] = max(runs.most_at_once.get(n, 0), runs.running[n])
        try:
            if n not in runs.faulted:
                runs.faulted.add(n)
                assert safe_time.locks.release(home, "blocker-token")  # the slot the copy tries first frees
                deliver_message(safe_time, export, (n,), task_id=task_id, attempt=attempt, redelivered=True)
            runs.completed[n] = runs.completed.get(n, 0) + 1
        finally:
            runs.running[n] -= 1

    assert deliver_message(safe_time, export, (0,), task_id=task_id, attempt=attempt) == "SUCCESS"
    # The copy was re-queued (not run); when it comes back, its delivery has finished: it is dropped.
    states = [r.state for r in safe_time.run_due(advance=timedelta(seconds=30), propagate=False)]
    assert states == ["IGNORED"]
    assert runs.completed == {0: 1}
    assert runs.most_at_once == {0: 1}
    # A late copy (the broker restored the message again) is dropped too, from whichever slot it asks.
    assert deliver_message(safe_time, export, (0,), task_id=task_id, attempt=attempt, redelivered=True) == "IGNORED"
    assert runs.completed == {0: 1}


def test_a_call_an_outer_gate_drops_gives_up_its_rate_place(safe_time: SafeTimeTesting) -> None:
    """overlap_lock(on_conflict="skip") above rate_limit("1/h"): a call the rate made wait, skipped by
    the lock when it comes back, frees its place at once instead of holding it for the hour."""
    ran: list[int] = []

    @safe_time.app.task(name="compose.skip_over_rate", bind=True, shared=False)
    @overlap_lock("skip-over-rate", ttl=60, on_conflict="skip")
    @rate_limit("skip-rate", "1/h")
    def sync(self: Task, n: int) -> None:
        ran.append(n)

    deliver_message(safe_time, sync, (0,), task_id="t0", attempt="a0")
    assert deliver_message(safe_time, sync, (1,), task_id="t1", attempt="a1") == "RETRY"
    assert safe_time.rate_window("skip-rate") == (1, 1)  # call 1 waits for its place
    holder = Owner(task_id="other", identity="other", host="h", pid=1)
    assert safe_time.locks.acquire("skip-over-rate", "other-token", 7200, holder).status == "acquired"
    states = [r.state for r in safe_time.run_due(advance=timedelta(hours=1), propagate=False)]
    assert states == ["SUCCESS"]  # skipped: the lock is held when it comes back
    assert ran == [0]
    # Its place is free again: the next call starts now, not a period after the dropped call's place.
    safe_time.locks.release("skip-over-rate", "other-token")
    assert deliver_message(safe_time, sync, (2,), task_id="t2", attempt="a2") == "SUCCESS"
    assert ran == [0, 2]


def test_an_entry_run_a_rate_limit_re_queues_is_queued_again(safe_time: SafeTimeTesting) -> None:
    """buffer_one over rate_limit: the run the rate sends back still counts as the entry's queued run
    (beat reads it from the marker and publishes no second waiting run beside it)."""

    @safe_time.app.task(name="compose.entry_rate", bind=True, shared=False)
    @rate_limit("entry-rate", "1/h")
    def report(self: Task) -> None: ...

    wrap_task(report)
    spec = {C.HEADER_OVERLAP: {"entry": "nightly", "policy": "buffer_one", "ttl": 60}}
    assert deliver_message(safe_time, report, (), task_id="r0", attempt="a0", headers=spec) == "SUCCESS"
    assert deliver_message(safe_time, report, (), task_id="r1", attempt="a1", headers=spec) == "RETRY"
    queued = safe_time.locks.unique_info(entry_key("nightly"), time.time())
    assert queued is not None
    assert queued.task_id == "r1"
    assert safe_time.locks.token_of(entry_key("nightly")) is None  # the lease is free meanwhile


def test_an_outer_idempotent_key_is_not_recorded_when_an_inner_gate_skipped_the_body(
    safe_time: SafeTimeTesting,
) -> None:
    """idempotent above overlap_lock(on_conflict="skip"): a call the lock skips did not do the work, so
    its idempotency key stays unrecorded and the next call of the key runs."""
    ran: list[int] = []

    @safe_time.app.task(name="compose.idem_over_skip", bind=True, shared=False)
    @idempotent("invoice:{n}", ttl=60)
    @overlap_lock("busy", ttl=60, on_conflict="skip")
    def invoice(self: Task, n: int) -> None:
        ran.append(n)

    holder = Owner(task_id="other", identity="other", host="h", pid=1)
    assert safe_time.locks.acquire("busy", "other-token", 60, holder).status == "acquired"
    assert deliver_message(safe_time, invoice, (1,), task_id="i1", attempt="a1") == "SUCCESS"
    assert ran == []
    assert not safe_time.locks.idempotent_done("invoice:1")
    safe_time.locks.release("busy", "other-token")
    assert deliver_message(safe_time, invoice, (1,), task_id="i2", attempt="a2") == "SUCCESS"
    assert ran == [1]
    assert safe_time.locks.idempotent_done("invoice:1")
