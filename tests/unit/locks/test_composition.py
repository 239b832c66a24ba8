"""Gates that compose (issue 38), on the memory backend, each delivery traced as a worker traces it.

The matrix is generated from :data:`GATES`: every pair, in both orders where the order is a choice
(a beat entry's run lease always wraps the task from outside; a stored delay, ``unique=`` and debounce
act at the publish, before any decorator), under every fault of :data:`FAULTS`.
A gate joins the matrix by joining the list. Whatever the stacking and the fault, each call's body
completes once, never beside a copy of itself, and nothing is left held or unfinished: no lock, no
unique claim, no stored row short of an end. Lock expiry follows the test clock here, so a killed
holder's lease runs out when the test moves the clock past its ttl.
(Real workers on Redis and PostgreSQL: tests/integration/locks/test_composition_worker.py.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Task
from celery.app.trace import build_tracer
from celery.exceptions import Reject
from celery.signals import before_task_publish

from celery_safe_time import concurrency_limit, idempotent, overlap_lock, rate_limit, signals
from celery_safe_time import constants as C
from celery_safe_time.config import get_config, reset_config
from celery_safe_time.exceptions import DebounceError
from celery_safe_time.locks.backends import Owner, use_lock_backend
from celery_safe_time.locks.backends.memory import MemoryLockBackend
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
    Gate(
        "unique_executing",
        task_options={"unique": "ue:{n}", "unique_until": "executing"},
        send_options={"countdown": 1},
    ),
    Gate("debounce", send_options={"debounce": 10, "debounce_key": "d:{n}"}),
]

#: Pairs refused at the call, with the error that names why.
REFUSED: dict[frozenset[str], type[Exception]] = {
    frozenset({"unique", "debounce"}): DebounceError,
    frozenset({"unique_executing", "debounce"}): DebounceError,
}

#: What happens to each call's first run:
#: ``none``; ``redelivery``: the broker hands the message out again while it runs (acks_late past the
#: visibility timeout); ``late_redelivery``: that copy arrives only after the run ended; ``retry``: the
#: body calls retry() once; ``reject_requeue``: the body raises Reject(requeue=True) once (the broker
#: delivers it again); ``worker_killed``: the worker dies mid-body (kill -9: nothing it held is given
#: back, nothing after that instant happens) and the broker delivers the unacknowledged message again
#: at once (as RabbitMQ does when the connection drops; Redis after its visibility timeout, later).
FAULTS = ["none", "redelivery", "late_redelivery", "retry", "reject_requeue", "worker_killed"]


class WorkerKilled(BaseException):
    """The worker's process died here: raised past every ``except Exception``, and what the gates'
    ``finally`` blocks then give back is put back as it was (:func:`frozen`)."""


def frozen(*backends: object) -> Callable[[], bool]:
    """A function putting the state (every dict, list and set attribute) of ``backends`` back as it
    is now: what a killed process held stays held, whatever its ``finally`` blocks did since. It
    returns whether anything had changed (a run killed inside a gate always leaves one held)."""
    saved = [
        (backend, {k: copy.deepcopy(v) for k, v in vars(backend).items() if isinstance(v, (dict, list, set))})
        for backend in backends
    ]

    def restore() -> bool:
        changed = False
        for backend, attrs in saved:
            for name, value in attrs.items():
                changed = changed or getattr(backend, name) != value
                setattr(backend, name, value)
        return changed

    return restore


def clock_locks(st: SafeTimeTesting) -> MemoryLockBackend:
    """Lock expiry on the test clock too (the kit keeps it on the real one), so the matrix can move
    past a dead holder's ttl."""
    store = st.store

    def pass_time(seconds: float) -> None:
        store.advance(max(0.0, seconds))

    locks = MemoryLockBackend(get_config(st.app), clock=store.time, rate_clock=store.time, rate_sleep=pass_time)
    use_lock_backend(st.app, locks)
    st.locks = locks
    return locks


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
#: Rounds of 15 s of test clock the matrix runs at most (20 minutes).
ROUNDS = 80


#: Rows still short of an end: ``sent`` too (the store may replace a sent row, but its delivery has
#: not ended: the sweep publishes it again after its grace).
_OPEN_STATUSES = frozenset({C.STATUS_PENDING, C.STATUS_CLAIMED, C.STATUS_SENT, C.STATUS_STARTED})


def _open_rows(st: SafeTimeTesting) -> list[tuple[str, str]]:
    return [(r.id, r.status) for r in st.store.rows() if r.status in _OPEN_STATUSES]


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
    retries: int = 0,
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
        "retries": retries,
        "is_eager": False,
        "hostname": "composition@test",
        "headers": message_headers,
        "root_id": task_id,
        "delivery_info": {"is_eager": False, "redelivered": redelivered},
    }
    tracer = build_tracer(task.name, task, eager=True, propagate=False, app=st.app)
    try:
        traced = tracer(task_id, list(args), {}, request)
    except WorkerKilled:
        return "KILLED"
    return traced.info.state if traced.info is not None else "SUCCESS"


#: What Celery itself puts in a message's headers (protocol 2); the rest are the package's own.
_CELERY_HEADERS = frozenset(
    {
        *("lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries", "timelimit"),
        *("root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result", "replaced_task_nesting"),
        *("stamped_headers", "stamps"),
    }
)


class Broker:
    """The matrix's broker: what the task publishes to the broker (not into the store: a re-queue of
    the delivery record, for one), delivered when its countdown has passed on the test clock."""

    def __init__(self, st: SafeTimeTesting, task_name: str) -> None:
        self.st = st
        self.task_name = task_name
        #: (due on the test clock, message headers, body)
        self.waiting: list[tuple[float, dict[str, Any], Any]] = []

    def on_publish(self, sender: Any = None, body: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if sender != self.task_name or headers is None:
            return
        eta = headers.get("eta")
        wait = (datetime.fromisoformat(eta) - datetime.now(timezone.utc)).total_seconds() if eta else 0.0
        self.waiting.append((self.st.store.time() + max(0.0, wait), dict(headers), body))

    def deliver_due(self, task: Task) -> int:
        """Deliver every message due by the test clock; how many."""
        now = self.st.store.time()
        due = [w for w in self.waiting if w[0] <= now]
        self.waiting = [w for w in self.waiting if w[0] > now]
        for _, headers, body in sorted(due, key=lambda w: w[0]):
            args = tuple(body[0]) if isinstance(body, (list, tuple)) else ()
            deliver_message(
                self.st,
                task,
                args,
                task_id=str(headers["id"]),
                attempt=str(headers.get(C.HEADER_ATTEMPT)),
                headers={k: v for k, v in headers.items() if k not in _CELERY_HEADERS and k != C.HEADER_ATTEMPT},
                retries=int(headers.get("retries") or 0),
            )
        return len(due)


@contextlib.contextmanager
def broker_of(st: SafeTimeTesting, task: Task) -> Iterator[Broker]:
    """A :class:`Broker` catching what ``task`` publishes while the block runs; the memory broker's
    queue (the process's) is emptied after it."""
    broker = Broker(st, task.name)
    before_task_publish.connect(broker.on_publish, weak=False)
    try:
        yield broker
    finally:
        before_task_publish.disconnect(broker.on_publish)
        with st.app.connection_for_write() as conn:
            conn.default_channel.queue_purge(st.app.conf.task_default_queue)


def _make_task(
    st: SafeTimeTesting, name: str, gates: tuple[Gate, ...], fault: str, runs: Runs, base: type[Task] | None = None
) -> Task:
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
                if fault == "late_redelivery":
                    task_id, headers = self.request.id, dict(self.request.headers or {})
                    copies.append(lambda: redeliver(task_id, headers, n))
                if fault == "worker_killed":
                    task_id, headers = self.request.id, dict(self.request.headers or {})
                    restore = frozen(st.locks, st.store)
                    copies.append(lambda: revive(restore, task_id, headers, n))
                    raise WorkerKilled
            runs.completed[n] = runs.completed.get(n, 0) + 1
        finally:
            runs.running[n] -= 1

    def revive(restore: Callable[[], bool], task_id: str, headers: dict[str, Any], n: int) -> None:
        assert restore(), "the killed run held nothing its finally blocks gave back"
        # Rows the dead run's sweep had claimed beside it are published by the sweep, not the worker.
        for row in st.store.rows():
            if row.status == C.STATUS_CLAIMED and row.claim_token is not None:
                st.store.release([row.id], row.claim_token)
        redeliver(task_id, headers, n)

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
    options: dict[str, Any] = {k: v for g in gates for k, v in g.task_options.items()}
    if base is not None:
        options["base"] = base
    task = st.app.task(name=name, bind=True, shared=False, acks_late=True, **options)(wrapped)
    if any(g.entry is not None for g in gates):
        wrap_task(task)
    task.pending_copies = copies
    return task


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(("outer", "inner"), _pairs(), ids=lambda g: g.name)
def test_stacked_gates_run_each_call_once(safe_time: SafeTimeTesting, outer: Gate, inner: Gate, fault: str) -> None:
    locks = clock_locks(safe_time)
    runs = Runs()
    task = _make_task(safe_time, f"compose.{outer.name}.{inner.name}.{fault}", (outer, inner), fault, runs)
    refused = REFUSED.get(frozenset({outer.name, inner.name}))
    if refused is not None:
        with pytest.raises(refused):
            task.apply_async((0,), **{**outer.send_options, **inner.send_options})
        return
    with broker_of(safe_time, task) as broker:
        _run_matrix_case(safe_time, task, runs, broker, outer, inner)
    assert runs.completed == dict.fromkeys(range(CALLS), 1)
    assert max(runs.most_at_once.values()) == 1  # a copy never runs beside its original
    # Nothing held or unfinished once every call ran (a dead holder's lease has run out).
    assert locks.scan() == []
    assert locks.scan_unique() == []
    assert _open_rows(safe_time) == []
    assert broker.waiting == []


def _plain_pairs() -> list[tuple[Gate, Gate]]:
    """The pairs a plain task (not a ``SafeTask``) can stack: the decorators and the entry's lease."""
    return [(o, i) for o, i in _pairs() if not (o.send_options or o.task_options or i.send_options or i.task_options)]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(("outer", "inner"), _plain_pairs(), ids=lambda g: g.name)
def test_stacked_gates_on_a_plain_task_run_each_call_once(
    safe_time: SafeTimeTesting, outer: Gate, inner: Gate, fault: str
) -> None:
    """The matrix on a plain ``Task``: its stored waits are checked against their rows by the first
    gate the delivery meets (``checked_delivery``), not by ``SafeTask``, and every row still ends."""
    locks = clock_locks(safe_time)
    runs = Runs()
    name = f"compose.plain.{outer.name}.{inner.name}.{fault}"
    task = _make_task(safe_time, name, (outer, inner), fault, runs, base=Task)
    with broker_of(safe_time, task) as broker:
        _run_matrix_case(safe_time, task, runs, broker, outer, inner)
    assert runs.completed == dict.fromkeys(range(CALLS), 1)
    assert max(runs.most_at_once.values()) == 1
    assert locks.scan() == []
    assert locks.scan_unique() == []
    assert _open_rows(safe_time) == []
    assert broker.waiting == []


def _run_matrix_case(
    safe_time: SafeTimeTesting, task: Task, runs: Runs, broker: Broker, outer: Gate, inner: Gate
) -> None:
    """Send the calls, then run the test clock forward until every call ran and nothing waits."""
    entry = outer.entry or inner.entry
    for n in range(CALLS):
        headers: dict[str, Any] = {}
        if entry is not None:
            # A short lease: a waiting run looks again every second, so a dead holder's 60 s would
            # cost the matrix a few hundred deliveries per call.
            headers[C.HEADER_OVERLAP] = {"entry": "compose", "policy": entry, "ttl": 15}
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
    # Until every call ran and nothing waits (a killed run's stored row is taken over once its
    # heartbeat stays stale for a lock ttl: several minutes of test clock per killed call).
    for _ in range(ROUNDS):
        try:
            safe_time.run_due(advance=timedelta(seconds=15), propagate=False)
        except WorkerKilled:
            pass  # the run_due "worker" died mid-row; its copy comes below
        while task.pending_copies or broker.deliver_due(task):
            while task.pending_copies:
                task.pending_copies.pop(0)()
        if len(runs.completed) == CALLS and not safe_time.stored_delays() and not broker.waiting:
            break


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


@pytest.fixture
def short_waits_in_broker(safe_time: SafeTimeTesting) -> SafeTimeTesting:
    """The kit with a delay threshold of 10 s: a gate's short wait goes to the broker, as in production
    (the kit stores every wait by default). The kit restores the threshold when it ends."""
    safe_time.app.conf.safe_time_delay_threshold = 10.0
    reset_config(safe_time.app)
    return safe_time


def _unique_executing_task(st: SafeTimeTesting, name: str, decorator: Decorator, body: Callable[..., None]) -> Task:
    return st.app.task(name=name, bind=True, shared=False, unique="ue:{n}", unique_until="executing")(decorator(body))


@pytest.mark.parametrize(
    ("gate", "busy"),
    [
        (lambda: overlap_lock("ue-gate", ttl=60, retry_after=5), ["ue-gate"]),
        (
            lambda: concurrency_limit("ue-gate", limit=2, ttl=60, retry_after=5),
            [slot_key("ue-gate", 0), slot_key("ue-gate", 1)],
        ),
    ],
    ids=["overlap_lock", "concurrency_limit"],
)
def test_unique_until_executing_holds_the_key_until_every_gate_admits_the_run(
    short_waits_in_broker: SafeTimeTesting, gate: Callable[[], Decorator], busy: list[str]
) -> None:
    """unique_until="executing" over a gate that sends the delivery back: the key stays the waiting
    call's while the gate turns it away (a delay() then hands back that call, never queues a second
    copy), and is freed once the gate admits the run (a delay() during the body queues the next)."""
    safe_time = short_waits_in_broker
    during_conflict: list[str] = []
    during_body: list[str] = []

    def sync(self: Task, n: int) -> None:
        during_body.append(task.delay(n).id)

    task = _unique_executing_task(safe_time, "compose.unique_executing", gate(), sync)

    def on_conflict(sender: Any = None, **_: Any) -> None:
        during_conflict.append(task.delay(1).id)

    signals.overlap_conflict.connect(on_conflict, weak=False)
    try:
        with broker_of(safe_time, task) as broker:
            # another holder has the gate's place: the first delivery is sent back
            holder = Owner(task_id="other", identity="other", host="h", pid=1)
            for key in busy:
                assert safe_time.locks.acquire(key, "other-token", 60, holder).status == "acquired"
            first = task.delay(1)
            assert broker.deliver_due(task) == 1
            assert during_conflict == [first.id]  # the key still names the waiting call
            held = safe_time.locks.unique_info("ue:1", time.time())
            assert held is not None
            assert (held.task_id, held.state) == (first.id, C.UNIQUE_STATE_RETRYING)
            assert task.delay(1).id == first.id  # re-queued: still the one copy
            # the gate's place frees: the re-queued delivery runs, and its key is free while it runs
            for key in busy:
                assert safe_time.locks.release(key, "other-token")
            safe_time.store.advance(10)
            assert broker.deliver_due(task) == 1
            assert len(during_body) == 1
            assert during_body[0] != first.id
            held = safe_time.locks.unique_info("ue:1", time.time())
            assert held is not None
            assert (held.task_id, held.state) == (during_body[0], C.UNIQUE_STATE_QUEUED)
    finally:
        signals.overlap_conflict.disconnect(on_conflict)


def test_unique_until_executing_frees_the_key_of_a_run_a_gate_skips(safe_time: SafeTimeTesting) -> None:
    """A delivery the gate drops (on_conflict="skip") never runs: its key is freed at its end, not left
    to its ttl."""
    ran: list[int] = []

    def sync(self: Task, n: int) -> None:
        ran.append(n)

    task = _unique_executing_task(
        safe_time, "compose.unique_executing_skip", overlap_lock("ue-skip", ttl=60, on_conflict="skip"), sync
    )
    holder = Owner(task_id="other", identity="other", host="h", pid=1)
    assert safe_time.locks.acquire("ue-skip", "other-token", 60, holder).status == "acquired"
    with broker_of(safe_time, task) as broker:
        first = task.delay(1)
        assert broker.deliver_due(task) == 1
    assert ran == []
    assert safe_time.locks.unique_info("ue:1", time.time()) is None
    assert task.delay(1).id != first.id


def test_a_stored_wait_the_entry_lease_sends_back_closes_its_row(short_waits_in_broker: SafeTimeTesting) -> None:
    """buffer_all over rate_limit: a run the rate made wait in the store, sent back by the entry's
    lease when its row comes due (another run holds it), ends that row (the copy goes on without its
    token, so nothing else would ever end it) and runs once, later."""
    safe_time = short_waits_in_broker
    clock_locks(safe_time)
    ran: list[str] = []

    @safe_time.app.task(name="compose.entry_lease_over_stored_rate", bind=True, shared=False, base=Task)
    @rate_limit("entry-stored-rate", "1/h")
    def report(self: Task) -> None:
        ran.append(self.request.id)

    wrap_task(report)
    spec = {C.HEADER_OVERLAP: {"entry": "hourly", "policy": "buffer_all", "ttl": 60}}
    assert deliver_message(safe_time, report, (), task_id="r0", attempt="a0", headers=spec) == "SUCCESS"
    assert deliver_message(safe_time, report, (), task_id="r1", attempt="a1", headers=spec) == "RETRY"
    assert _open_rows(safe_time) == [("r1", C.STATUS_PENDING)]  # the rate's wait is in the store
    holder = Owner(task_id="r2", identity="r2", host="h", pid=1)
    assert safe_time.locks.acquire(entry_key("hourly"), "other-token", 7200, holder).status == "acquired"
    with broker_of(safe_time, report) as broker:
        states = [r.state for r in safe_time.run_due(advance=timedelta(hours=1), propagate=False)]
        assert states == ["RETRY"]  # the lease is held: the run waits on, in the broker
        assert ran == ["r0"]
        assert _open_rows(safe_time) == []
        assert len(broker.waiting) == 1
        safe_time.locks.release(entry_key("hourly"), "other-token")
        safe_time.advance(5)
        assert broker.deliver_due(report) == 1
    assert ran == ["r0", "r1"]  # in its rate place, once
    assert broker.waiting == []
    assert _open_rows(safe_time) == []


def test_a_stored_wait_whose_entry_run_already_ran_closes_its_row(short_waits_in_broker: SafeTimeTesting) -> None:
    """A stored row's delivery the entry lease drops as already run (its delivery finished under the
    lease) ends the row: it is not left ``sent`` for the sweep to publish again (and run again)."""
    safe_time = short_waits_in_broker
    clock_locks(safe_time)
    ran: list[str] = []

    @safe_time.app.task(name="compose.entry_lease_drops_stored", bind=True, shared=False, base=Task)
    @rate_limit("entry-dropped-rate", "1/h")
    def report(self: Task) -> None:
        ran.append(self.request.id)

    wrap_task(report)
    spec = {C.HEADER_OVERLAP: {"entry": "daily", "policy": "buffer_all", "ttl": 60}}
    assert deliver_message(safe_time, report, (), task_id="r0", attempt="a0", headers=spec) == "SUCCESS"
    assert deliver_message(safe_time, report, (), task_id="r1", attempt="a1", headers=spec) == "RETRY"
    # The same delivery ran to its end meanwhile (a broker copy of the wait, say): its lease says so.
    owner = Owner(task_id="r1", identity="a1", host="h", pid=1)
    taken = safe_time.locks.acquire(entry_key("daily"), "r1-token", 60, owner)
    assert taken.status == "acquired"
    safe_time.locks.release(entry_key("daily"), "r1-token", finished=("a1", 3600.0, "r1"))
    states = [r.state for r in safe_time.run_due(advance=timedelta(hours=1), propagate=False)]
    assert states == ["IGNORED"]
    assert ran == ["r0"]
    assert _open_rows(safe_time) == []
    # A row left sent would be published again after the grace, and run a second time once the
    # lease's record of the finished delivery had expired.
    safe_time.advance(3600 + get_config(safe_time.app).delivery_grace)
    assert safe_time.store.requeue_unstarted(get_config(safe_time.app).delivery_grace) == 0
    assert safe_time.run_due(advance=timedelta(seconds=1), propagate=False) == []
    assert ran == ["r0"]


def test_a_retry_from_a_stored_wait_is_a_new_delivery(short_waits_in_broker: SafeTimeTesting) -> None:
    """A plain task's ``self.retry()`` in the run of a stored wait: the retried message carries no
    delivery token of that row (``retry()`` copies the request's headers), so it runs, instead of
    being dropped as the row's finished delivery."""
    safe_time = short_waits_in_broker
    clock_locks(safe_time)
    ran: list[str] = []

    @safe_time.app.task(name="compose.retry_from_stored_wait", bind=True, shared=False, base=Task)
    @rate_limit("retry-stored-rate", "1/h")
    def sync(self: Task) -> None:
        ran.append(f"{self.request.id}:{self.request.retries}")
        if self.request.id == "r1" and not self.request.retries:
            raise self.retry(countdown=1)

    assert deliver_message(safe_time, sync, (), task_id="r0", attempt="a0") == "SUCCESS"
    assert deliver_message(safe_time, sync, (), task_id="r1", attempt="a1") == "RETRY"
    with broker_of(safe_time, sync) as broker:
        states = [r.state for r in safe_time.run_due(advance=timedelta(hours=1), propagate=False)]
        assert states == ["RETRY"]  # the body ran and called retry()
        assert [h.get(C.HEADER_DELIVERY) for _, h, _ in broker.waiting] == [None]
        safe_time.advance(5)
        assert broker.deliver_due(sync) == 1  # a new call through the rate: it waits for the next place
    states = [r.state for r in safe_time.run_due(advance=timedelta(hours=1), propagate=False)]
    assert states == ["SUCCESS"]
    assert ran == ["r0:0", "r1:0", "r1:1"]
    assert _open_rows(safe_time) == []
