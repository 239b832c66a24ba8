"""The worker side of a stored delay's delivery record: start it once, keep it alive, record how it ended.

The sweep publishes a row with its delivery token (``safe_time_delivery``). Before the body runs,
:func:`run_delivery` makes one conditional update of that row in the store (:meth:`DelayStore.start`):
whichever copy of the delivery wins it runs, every other copy learns why it must not:

- the same delivery runs elsewhere with a fresh heartbeat (a redelivered copy): re-queue this copy,
  never ack and drop it, because the other run may still die;
- it already ran to an end, or was cancelled: drop this copy;
- the row has another token (rescheduled, or a new call reused the task id): this message is stale.

While the body runs a heartbeat keeps ``heartbeat_at`` fresh (every ``safe_time_lock_ttl / 3``). A
run counts as dead when its heartbeat was found older than ``safe_time_lock_ttl`` and stayed so for
another ``safe_time_lock_ttl`` (``suspected_at``: the first look after a store outage, which stops
every heartbeat at once, must not take over). Then an ``acks_late`` redelivery after a ``kill -9``
takes over, at least once, never beside a live run. The end is recorded
as ``finished`` with the outcome. The store is the truth here, not Redis: a Redis reset forgets
nothing, and a reused task id gets a new token, so it runs again.
"""

from __future__ import annotations

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
from ..exceptions import StoreError
from ..locks.watchdog import Watchdog
from ..requeue import jittered
from .stores import get_store
from .stores.base import DelayStore

logger = logging.getLogger(__name__)

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
        started = store.start(request.id, token, run_id, worker, stale_after=config.lock_ttl, prior_runs=prior)
    except StoreError as exc:
        # The start may have been written and only its reply lost: the copy carries this run id, so
        # it recognises the start as its own instead of waiting out a heartbeat that never comes.
        requeue_unchecked(task, exc, prior_runs=[*prior, run_id])
        logger.warning("running stored task %s[%s] without its delivery record", task.name, request.id)
        return body()
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


def _run_started(
    task: Task, config: SafeTimeConfig, store: DelayStore, token: str, run_id: str, body: Callable[[], R]
) -> R:
    task_id = task.request.id

    def lost(reason: str) -> None:
        logger.warning("stored task %s[%s] stopped its heartbeat: %s", task.name, task_id, reason)

    def beat(_ttl: float) -> bool:
        try:
            return store.heartbeat(task_id, token, run_id)
        except StoreError as exc:
            # Keep the run going and try again next interval: a sweep cannot reach the store either.
            logger.warning("heartbeat of stored task %s[%s] failed, retrying: %s", task.name, task_id, exc)
            return True

    # ttl=inf: a store outage never ends the heartbeat (it keeps trying every interval); only a
    # refused heartbeat does (the row moved on: taken over after this run looked dead, or replaced).
    watchdog = Watchdog(
        beat,
        lost,
        ttl=math.inf,
        interval=config.lock_ttl / 3.0,
    ).start()
    outcome, error = C.OUTCOME_FAILED, None
    try:
        value = body()
        outcome = C.OUTCOME_SUCCEEDED
        return value
    except Retry:
        outcome = C.OUTCOME_RETRIED
        raise
    except (Ignore, Reject):
        outcome = C.OUTCOME_IGNORED
        raise
    except BaseException as exc:
        error = f"{exc.__class__.__name__}: {exc}"
        raise
    finally:
        # The heartbeat stays on until the end is written: a row that looked dead meanwhile would be
        # run again (acks_late) or marked interrupted although it ran to its end.
        # Any other run's forgotten end only shows as interrupted: it need not wait for the disk.
        recorded = finish_retrying(
            store, task_id, token, run_id, outcome, error, budget=config.lock_ttl / 2.0, durable=reruns_when_stale(task)
        )
        if recorded is None:
            budget = max(config.claim_timeout, C.DELIVERY_FINISH_BACKGROUND_BUDGET)
            _finish_later(store, task_id, token, run_id, outcome, error, watchdog, budget)
        else:
            watchdog.stop()


def _finish_later(
    store: DelayStore,
    task_id: str,
    token: str,
    run_id: str,
    outcome: str,
    error: str | None,
    watchdog: Watchdog,
    budget: float,
) -> None:
    """Keep trying to record the end (and the heartbeat alive) in the background: the worker moves on."""

    def run() -> None:
        try:
            if finish_retrying(store, task_id, token, run_id, outcome, error, budget=budget) is None:
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
    deadline = clock() + budget
    waits = iter(_FINISH_RETRY_DELAYS)
    while True:
        try:
            recorded = store.finish(task_id, token, run_id, outcome, error, durable=durable)
        except StoreError as exc:
            wait = next(waits, _FINISH_RETRY_DELAYS[-1])
            if clock() + wait > deadline:
                logger.debug("recording the end of stored task %s failed: %s", task_id, exc)
                return None
            sleep(wait)
            continue
        if not recorded:
            logger.debug("stored task %s ended (%s); its row has moved on", task_id, outcome)
        return recorded


def _requeue(task: Task, countdown: float, prior_runs: Sequence[str], exc: Exception | None = None) -> None:
    """Publish this delivery again in ``countdown`` seconds (same id, retries, token) and end this run.

    Goes through ``Task.apply_async``, not SafeTask's: that one strips the delivery headers (a
    retry is a new delivery) and could store the copy as a new row.
    """
    request = task.request
    headers = dict(request.headers or {})
    headers[C.HEADER_PRIOR_RUNS] = list(prior_runs)[-C.DELIVERY_PRIOR_RUNS_KEPT :]
    sig = task.signature_from_request(request, countdown=countdown, headers=headers)
    Task.apply_async(task, sig.args, sig.kwargs, **sig.options)
    raise Retry(exc=exc, when=countdown, sig=sig)


def requeue_unchecked(task: Task, exc: Exception, *, prior_runs: Sequence[str]) -> None:
    """Send this delivery again in a few seconds instead of running it without its delivery record.

    Only when the copy cannot be published either (the broker is down too) does this return and the
    task run unchecked: the message is already off the queue, and losing it would be worse than a
    possible repeat.
    """
    request = task.request
    countdown = jittered(C.DELIVERY_RETRY_AFTER, C.DELIVERY_RETRY_JITTER)
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
