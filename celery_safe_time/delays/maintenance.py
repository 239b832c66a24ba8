"""The sweep's maintenance: delivery confirmation (rows that never started, runs whose heartbeat stopped)
and the retention purge of finished rows."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

from celery import Celery

from .. import constants as C
from ..config import SafeTimeConfig
from ..exceptions import StoreError
from .backends.base import DelayStore
from .delivery import reruns_when_stale
from .publish import SweepStats
from .revoked import REASON_EXPIRED, report_revoked

logger = logging.getLogger(__name__)

#: The sweep's retention purge runs at most once per this many seconds per process...
PURGE_INTERVAL = 3600.0
#: ...and deletes at most this many batches per sweep, so a sweep never stalls behind a big purge.
PURGE_SWEEP_MAX_BATCHES = 5


def suspicion_look_gap(config: SafeTimeConfig) -> float:
    """The longest gap between two sweeps' looks at a suspected run that still counts as the store
    answering throughout: a longer one (an outage, or no sweep) starts the suspicion over.

    Half the lock ttl leaves a run's heartbeat (every third of it) at least one write while the
    store answers, whatever outage shorter than the gap went unseen; twice the sweep interval keeps
    sweeps that look on time from starting it over (which would never take over a dead run)."""
    return max(config.lock_ttl / 2.0, 2.0 * config.sweep_interval)


def confirm_deliveries(
    app: Celery, config: SafeTimeConfig, store: DelayStore, stats: SweepStats, *, limit: int
) -> None:
    """Delivery confirmation: a published row must start, a started row must keep its heartbeat.

    A row ``sent`` but not started ``safe_time_delivery_grace`` after its due time lost its message
    (a broker restart, kombu's window between BRPOP and the unacked copy on a worker ``kill -9``): it
    goes back to pending with the same token and is published again; the conditional start keeps it
    to one run. A row ``started`` whose heartbeat is older than ``safe_time_lock_ttl`` lost its worker:
    an ``acks_late`` task runs again (at least once, as acks_late promises), any other task is
    marked ``interrupted`` and not run again (at most once). It is taken over only once it stayed
    silent for another ``safe_time_lock_ttl`` while the store answered the sweeps' looks: time the
    store was unreachable (no heartbeat could be written) does not count.
    """
    # First: a row whose message expired is closed now, not published again after the grace.
    close_expired_unstarted(app, store, stats, limit=limit)
    try:
        stats.republished = store.requeue_unstarted(config.delivery_grace)
        if stats.republished:
            logger.warning(
                "%d stored delays were published but not started within %gs: publishing them again",
                stats.republished,
                config.delivery_grace,
            )
        stale = store.stale_started(config.lock_ttl, limit)
    except StoreError as exc:
        logger.warning("delivery confirmation skipped this sweep: %s", exc)
        return
    looked_within = suspicion_look_gap(config)
    for row in stale:
        task = app.tasks.get(row.task)
        rerun = reruns_when_stale(task)
        try:
            changed = store.end_stale(
                row.id, row.delivery_token or "", config.lock_ttl, rerun=rerun, looked_within=looked_within
            )
        except StoreError as exc:
            logger.warning("delivery confirmation of %s[%s] skipped: %s", row.task, row.id, exc)
            continue
        if not changed:
            continue
        if rerun:
            stats.rerun += 1
        else:
            stats.interrupted += 1
        ending = "running it again (acks_late)" if rerun else "interrupted, not run again"
        logger.warning(
            "stored task %s[%s] started on %s but its heartbeat stopped: %s", row.task, row.id, row.worker, ending
        )


def close_expired_unstarted(app: Celery, store: DelayStore, stats: SweepStats, *, limit: int) -> None:
    """Rows published but not started whose ``expires`` has passed become ``expired`` now, and their
    tasks report ``REVOKED`` (``TaskRevokedError('expired')``), as Celery's worker reports a message it
    discards as expired. A broker that drops an expired message (RabbitMQ's per-message TTL) never
    shows it to a worker, and without this the row would wait out ``safe_time_delivery_grace`` and
    be published again only to expire then.
    """
    try:
        found = store.expired_unstarted(limit)
        closed = [row for row in found if store.end_expired(row.id, row.delivery_token or "")]
    except StoreError as exc:
        logger.warning("closing expired published delays skipped this sweep: %s", exc)
        return
    if not closed:
        return
    stats.expired += len(closed)
    logger.info("%d published stored delays expired before they started: closed as expired", len(closed))
    # A worker that got the message after its expiry (Redis) discarded it and reported it already.
    report_revoked(app, closed, REASON_EXPIRED, expired=True, unless_recorded=True)


#: Per store object (so per process): the ``clock()`` time before which its next purge pass waits.
_next_purge: weakref.WeakKeyDictionary[DelayStore, float] = weakref.WeakKeyDictionary()
_purge_lock = threading.Lock()


def purge_retained(
    store: DelayStore,
    retention: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    interval: float = PURGE_INTERVAL,
    max_batches: int = PURGE_SWEEP_MAX_BATCHES,
    batch: int = C.PURGE_BATCH,
) -> int:
    """Delete sent/cancelled/expired rows older than ``retention`` seconds, if this process's pass is due.

    A pass starts at most once per ``interval``; each call deletes at most ``max_batches`` batches so
    the sweep that runs it is never held up. A pass that hit that cap goes on at the next sweep
    instead of waiting out the interval, so a busy table still shrinks. Failed rows are never
    purged here: they wait for an operator. A store error is logged, not raised: the sweep's
    publishing already happened and must be reported.
    """
    with _purge_lock:
        now = clock()
        if now < _next_purge.get(store, now):
            return 0
        # Claim the pass before running it so concurrent sweeps of this process skip it.
        _next_purge[store] = now + interval
    purged = 0
    try:
        before = store.now() - timedelta(seconds=retention)
        for _ in range(max_batches):
            deleted = store.purge(before, C.PURGE_DEFAULT_STATUSES, batch)
            purged += deleted
            if deleted < batch:
                break
        else:
            with _purge_lock:
                _next_purge[store] = now  # more left: carry on at the next sweep
    except StoreError as exc:
        logger.warning("retention purge stopped after %d rows, retrying in %.0fs: %s", purged, interval, exc)
    if purged:
        logger.info("retention purge: deleted %d finished stored delays older than %gs", purged, retention)
    return purged
