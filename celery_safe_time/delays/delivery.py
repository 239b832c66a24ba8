"""The worker side of a stored delay's delivery record: start it once, keep it alive, record how it ended.

Before the body runs, :func:`run_delivery` makes one conditional update of the row
(:meth:`DelayStore.start`): the copy that wins runs; a copy of a delivery running elsewhere with a
fresh heartbeat is re-queued (never dropped: that run may still die); a finished, cancelled or
superseded one is dropped. While the body runs a heartbeat keeps ``heartbeat_at`` fresh; a run whose
heartbeat stayed stale for two ``safe_time_lock_ttl`` (``suspected_at``: one store outage stops
every heartbeat at once) is taken over by an ``acks_late`` redelivery. The store is the truth, not
Redis.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from .. import constants as C
from .. import signals
from ..config import SafeTimeConfig, get_config
from ..exceptions import LockLost, StoreError
from ..locks.watchdog import Interrupter, Watchdog
from ..messages.compat import routable_countdown
from ..messages.requeue import jittered
from .backends import get_store
from .backends.base import DelayStore

logger = logging.getLogger(__name__)

#: When the store cannot record a delivery's start the task is re-queued (not run) this many seconds
#: later, plus up to ``DELIVERY_RETRY_JITTER`` seconds so a backlog does not return at once.
DELIVERY_RETRY_AFTER = 5.0
DELIVERY_RETRY_JITTER = 5.0
#: Most run ids carried in ``safe_time_prior_runs`` (a chain of lost replies is short).
DELIVERY_PRIOR_RUNS_KEPT = 8
#: How long the renewer thread waits for a delivery heartbeat's write before it looks again on the next
#: tick (the write goes on in its own thread): a hung store call must not hold up the process's renewals.
DELIVERY_HEARTBEAT_WAIT = 0.5
#: How long a worker keeps trying, in a thread per run, to record an end the unreachable store did not
#: take, the heartbeat kept on: as long as an outage plausibly lasts, or the sweep would run an
#: acks_late task again after a short outage although its worker knew it had ended.
DELIVERY_FINISH_BACKGROUND_BUDGET = 3600.0

R = TypeVar("R")

_HOST = socket.gethostname()

#: Back-off between attempts to record a delivery's end while the store is unreachable.
_FINISH_RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0)


def delivery_token(request: Any) -> str | None:
    """The delivery token of a stored delivery, or None for a message the sweep did not publish."""
    headers = getattr(request, "headers", None) or {}
    token = headers.get(C.HEADER_DELIVERY)
    return str(token) if token else None


def reruns_when_stale(task: Task | None) -> bool:
    """Whether a started run of ``task`` whose heartbeat stopped is run again (``acks_late``: at least
    once) rather than marked interrupted. Such a run's end must reach the disk: forgotten, it would
    look stale and run again."""
    return bool(task is not None and getattr(task, "acks_late", False))


def _prior_runs(request: Any) -> list[str]:
    headers = getattr(request, "headers", None) or {}
    runs = headers.get(C.HEADER_PRIOR_RUNS) or []
    return [str(run) for run in runs] if isinstance(runs, (list, tuple)) else []


def run_delivery(task: Task, token: str, body: Callable[[], R]) -> R:
    """Run ``body`` if this message wins its delivery's conditional start; raise ``Ignore`` or
    ``Retry`` (a re-queued copy) otherwise. Records the start, a heartbeat and the outcome."""
    app = task._get_app()
    config = get_config(app)
    store = get_store(app)
    request = task.request
    prior = _prior_runs(request)
    run_id = uuid.uuid4().hex
    worker = str(request.hostname or _HOST)
    try:
        started = store.start(
            request.id,
            token,
            run_id,
            worker,
            stale_after=config.lock_ttl,
            prior_runs=prior,
            leeway=config.max_clock_skew,
        )
    except StoreError as exc:
        # The start may have been written and only its reply lost: the copy carries this run id, so
        # it recognises the start as its own instead of waiting out a heartbeat that never comes.
        requeue_unchecked(task, exc, prior_runs=[*prior, run_id])
        logger.warning("running stored task %s[%s] without its delivery record", task.name, request.id)
        return body()
    if started.verdict == "early":
        # Published ahead with its eta, which this worker's clock reached early: wait out the rest,
        # as measured by the store. The copy's own eta comes from this clock too, so it arrives on
        # time here, and late (never early) on a worker whose clock is right.
        logger.warning(
            "stored task %s[%s] arrived %.2fs before its due time by the store's clock (this worker's clock "
            "is fast?): re-queueing it for then",
            task.name,
            request.id,
            started.early_by,
        )
        _requeue(task, started.early_by, prior)
    if started.verdict == "running":
        row = started.row
        recheck = config.lock_ttl * C.DELIVERY_RUNNING_RECHECK
        countdown = jittered(recheck, recheck / 2)
        logger.warning(
            "stored task %s[%s] is running on %s (heartbeat %s): re-queueing this copy in %.1fs",
            task.name,
            request.id,
            row.worker if row else "?",
            row.heartbeat_at.isoformat() if row and row.heartbeat_at else "?",
            countdown,
        )
        _requeue(task, countdown, prior)
    if started.verdict != "run":
        row = started.row
        logger.warning(
            "skipping a stale delivery of stored task %s[%s]: %s (row %s%s)",
            task.name,
            request.id,
            started.verdict,
            row.status if row else "gone",
            f", outcome {row.outcome}" if row and row.outcome else "",
        )
        signals.delay_delivery_skipped.send(sender=task, task_id=request.id, reason=started.verdict)
        raise Ignore()
    return _run_started(task, config, store, token, run_id, body)


class _Heartbeat:
    """The heartbeat of one started run, ticked by the process's renewer thread (:class:`Watchdog`).

    Each write runs on a thread of its own, waited for at most ``DELIVERY_HEARTBEAT_WAIT``, so a hung
    store call never holds up the renewer. ``ttl``: how long the run goes on without a heartbeat written
    (``inf``: never); past it the watchdog's ``on_lost`` raises :class:`LockLost` in the task's thread,
    since the sweep may start the delivery again. A heartbeat the store refuses (the row moved on) only
    ends the heartbeat.
    """

    def __init__(
        self,
        task: Task,
        store: DelayStore,
        token: str,
        run_id: str,
        *,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.task = task
        self.task_id = str(task.request.id)
        self.store = store
        self.token = token
        self.run_id = run_id
        self.ttl = ttl
        self._clock = clock
        self.last_ok = clock()
        #: False once the body has ended: the run then keeps its row whatever the silence, and the
        #: heartbeat goes on until the end is recorded (a stale row would be run again).
        self.armed = True
        #: Why the run gave its row up (None: it did not).
        self.lost_reason: str | None = None
        self._reason = ""
        self._silent = False
        self._pending: _Write | None = None
        # Made here, on the task's thread: it raises in this thread.
        self.interrupter = Interrupter() if math.isfinite(ttl) else None

    def beat(self, _ttl: float) -> bool:
        """One tick: True to go on, False when the row is given up (``on_lost`` follows)."""
        now = self._clock()
        write = self._pending
        if write is None:
            write = self._pending = _Write(lambda: self.store.heartbeat(self.task_id, self.token, self.run_id), now)
        if write.done.wait(DELIVERY_HEARTBEAT_WAIT):
            self._pending = None
            if write.error is None and not write.ok:
                self._reason = "the store refused the heartbeat: the row moved on"
                self._silent = False
                return False
            if write.error is None:
                self.last_ok = write.sent
                return True
            logger.warning(
                "heartbeat of stored task %s[%s] failed, retrying: %s", self.task.name, self.task_id, write.error
            )
        else:
            logger.warning(
                "heartbeat of stored task %s[%s] unanswered for %.1fs",
                self.task.name,
                self.task_id,
                self._clock() - write.sent,
            )
        silent = self._clock() - self.last_ok
        if self.armed and silent >= self.ttl:
            self._reason = f"no heartbeat written for {silent:.1f}s (safe_time_lock_ttl {self.ttl:g}s)"
            self._silent = True
            return False
        return True

    def lost(self, _reason: str) -> None:
        """The watchdog's ``on_lost``: runs on the renewer thread, under the watchdog's mutex."""
        if self.interrupter is None or not self._silent:
            logger.warning("stored task %s[%s] stopped its heartbeat: %s", self.task.name, self.task_id, self._reason)
            return
        self.lost_reason = self._reason
        logger.error(
            "stored task %s[%s] lost its delivery record: %s; interrupting it (the sweep runs it again)",
            self.task.name,
            self.task_id,
            self._reason,
        )
        self.interrupter.fire(LockLost)

    def disarm(self) -> None:
        """The body has ended: silence no longer gives the row up, nor interrupts anything; the
        heartbeat keeps trying until the end is recorded (or the row moved on)."""
        self.armed = False
        if self.interrupter is not None:
            self.interrupter.disarm()


class _Write:
    """One store write on a daemon thread of its own; ``done`` is set when it returned or raised."""

    def __init__(self, call: Callable[[], bool], sent: float) -> None:
        self.sent = sent
        self.ok = False
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._call = call
        threading.Thread(target=self._run, name="safe-time-heartbeat", daemon=True).start()

    def _run(self) -> None:
        try:
            self.ok = self._call()
        except BaseException as exc:  # reported by the next tick
            self.error = exc
        finally:
            self.done.set()


def _run_started(
    task: Task, config: SafeTimeConfig, store: DelayStore, token: str, run_id: str, body: Callable[[], R]
) -> R:
    task_id = task.request.id
    reruns = reruns_when_stale(task)
    # A run that is not run again when its heartbeat stops (no acks_late) goes on through a store
    # outage (ttl inf): it only stops heartbeating when the row moved on. An acks_late run gives
    # the row up after safe_time_lock_ttl without a heartbeat written, before the sweep may take it
    # over (a heartbeat stale for safe_time_lock_ttl, then suspected for as long again).
    heartbeat = _Heartbeat(task, store, token, run_id, ttl=config.lock_ttl if reruns else math.inf)
    watchdog = Watchdog(heartbeat.beat, heartbeat.lost, ttl=math.inf, interval=config.lock_ttl / 3.0).start()
    outcome, error = C.OUTCOME_FAILED, None
    try:
        value = body()
        outcome = C.OUTCOME_SUCCEEDED
        return value
    except Retry:
        outcome = C.OUTCOME_RETRIED
        raise
    except Reject as exc:
        # Reject(requeue=True) gives this very message back to the broker: it must find the row startable.
        outcome = _HANDED_BACK if exc.requeue else C.OUTCOME_IGNORED
        raise
    except Ignore:
        outcome = C.OUTCOME_IGNORED
        raise
    except LockLost as exc:
        if heartbeat.lost_reason is None:
            error = f"{exc.__class__.__name__}: {exc}"
            raise
        raise LockLost(f"stored task {task_id} lost its delivery record: {heartbeat.lost_reason}") from exc
    except BaseException as exc:
        error = f"{exc.__class__.__name__}: {exc}"
        if reruns and not isinstance(exc, Exception):
            # SystemExit, KeyboardInterrupt: the worker process goes down without acknowledging the
            # message (or gives it back, reject_on_worker_lost): it comes back and must run.
            outcome = _HANDED_BACK
        raise
    finally:
        heartbeat.disarm()
        _record_end(task, config, store, token, run_id, outcome, error, watchdog, heartbeat.lost_reason)


#: Internal outcome of a run whose message goes back to the broker: the row is handed back, not finished.
_HANDED_BACK = "handed_back"


def _record_end(
    task: Task,
    config: SafeTimeConfig,
    store: DelayStore,
    token: str,
    run_id: str,
    outcome: str,
    error: str | None,
    watchdog: Watchdog,
    lost_reason: str | None,
) -> None:
    task_id = str(task.request.id)
    if lost_reason is not None and outcome != C.OUTCOME_SUCCEEDED:
        # The run gave its row up: the sweep starts it again (it may already have); nothing to write.
        watchdog.stop()
        return
    if outcome == _HANDED_BACK:
        handed = _write_retrying(
            lambda: store.hand_back(task_id, token, run_id), task_id, "hand back", budget=config.lock_ttl / 2.0
        )
        watchdog.stop()
        if handed is None:
            logger.warning(
                "stored task %s[%s] gave its message back but the store did not take it; it runs again once its "
                "heartbeat is found stale",
                task.name,
                task_id,
            )
        return
    # The heartbeat stays on until the end is written: a row that looked dead meanwhile would be
    # run again (acks_late) or marked interrupted although it ran to its end.
    # Any other run's forgotten end only shows as interrupted: it need not wait for the disk.
    recorded = finish_retrying(
        store, task_id, token, run_id, outcome, error, budget=config.lock_ttl / 2.0, durable=reruns_when_stale(task)
    )
    if recorded is None:
        budget = max(config.claim_timeout, DELIVERY_FINISH_BACKGROUND_BUDGET)
        record = functools.partial(finish_retrying, store, task_id, token, run_id, outcome, error, budget=budget)
        _finish_later(task_id, outcome, record, watchdog, budget)
    else:
        watchdog.stop()


def _finish_later(task_id: str, outcome: str, record: Callable[[], object], watchdog: Watchdog, budget: float) -> None:
    """Keep trying to ``record`` the end (and the heartbeat alive) in the background: the worker moves on."""

    def run() -> None:
        try:
            if record() is None:
                logger.error(
                    "stored task %s ended (%s) but the store did not record it within %.0fs; it counts as "
                    "interrupted (or runs again if acks_late) once its heartbeat is found stale",
                    task_id,
                    outcome,
                    budget,
                )
        finally:
            watchdog.stop()

    threading.Thread(target=run, name=f"safe-time-finish-{task_id}", daemon=True).start()
    logger.warning(
        "stored task %s ended (%s); the store is unreachable, recording it in the background", task_id, outcome
    )


def finish_retrying(
    store: DelayStore,
    task_id: str,
    token: str,
    run_id: str,
    outcome: str,
    error: str | None,
    *,
    budget: float,
    durable: bool = True,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool | None:
    """Record the delivery's end, retrying a store error for up to ``budget`` seconds; never raises.

    True: recorded. False: the row moved on (``retry(countdown=...)`` replaced it, or another run took
    it over). None: the store did not answer in time.
    """
    recorded = _write_retrying(
        lambda: store.finish(task_id, token, run_id, outcome, error, durable=durable),
        task_id,
        "record the end",
        budget=budget,
        sleep=sleep,
        clock=clock,
    )
    if recorded is False:
        logger.debug("stored task %s ended (%s); its row has moved on", task_id, outcome)
    return recorded


def _write_retrying(
    write: Callable[[], bool],
    task_id: str,
    what: str,
    *,
    budget: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool | None:
    """``write()``, retrying a store error for up to ``budget`` seconds; None when it never answered."""
    deadline = clock() + budget
    waits = iter(_FINISH_RETRY_DELAYS)
    while True:
        try:
            return write()
        except StoreError as exc:
            wait = next(waits, _FINISH_RETRY_DELAYS[-1])
            if clock() + wait > deadline:
                logger.debug("could not %s of stored task %s: %s", what, task_id, exc)
                return None
            sleep(wait)


def _requeue(task: Task, countdown: float, prior_runs: Sequence[str], exc: Exception | None = None) -> None:
    """Publish this delivery again in ``countdown`` seconds (same id, retries, token) and end this run.

    Goes through ``Task.apply_async``, not SafeTask's: that one strips the delivery headers (a
    retry is a new delivery) and could store the copy as a new row.
    """
    request = task.request
    headers = dict(request.headers or {})
    headers[C.HEADER_PRIOR_RUNS] = list(prior_runs)[-DELIVERY_PRIOR_RUNS_KEPT:]
    sig = task.signature_from_request(request, countdown=routable_countdown(task.app, countdown), headers=headers)
    Task.apply_async(task, sig.args, sig.kwargs, **sig.options)
    raise Retry(exc=exc, when=countdown, sig=sig)


def requeue_unchecked(task: Task, exc: Exception, *, prior_runs: Sequence[str]) -> None:
    """Send this delivery again in a few seconds instead of running it without its delivery record.

    Only when the copy cannot be published either (the broker is down too) does this return and the
    task run unchecked: the message is already off the queue, and losing it would be worse than a
    possible repeat.
    """
    request = task.request
    countdown = jittered(DELIVERY_RETRY_AFTER, DELIVERY_RETRY_JITTER)
    try:
        _requeue(task, countdown, prior_runs, exc)
    except Retry:
        logger.warning(
            "delivery record unavailable for stored task %s[%s], re-queued in %.1fs: %s",
            task.name,
            request.id,
            countdown,
            exc,
        )
        raise
    except Exception as publish_error:
        logger.warning(
            "delivery record unavailable for stored task %s[%s] (%s) and re-queueing failed (%s): running it",
            task.name,
            request.id,
            exc,
            publish_error,
        )
