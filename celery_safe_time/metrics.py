"""Optional Prometheus metrics (``pip install celery-safe-time[metrics]``).

``enable_metrics()`` connects counters to :mod:`celery_safe_time.signals` in this process;
expose them the usual way (``prometheus_client.start_http_server(9808)`` in the worker/beat,
or the multiprocess collector for prefork workers).

``register_gauges(app)`` adds a collector whose gauges (stored delays per status, lateness of the
oldest due delay, the beat lease holder and epoch, held locks) are read from the store and Redis
when Prometheus scrapes, not kept per event: register it in one process per deployment (a beat, or
``celery safe-time metrics --port 9808``), since every process would report the same numbers.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery

from . import constants as C
from . import signals
from .beat.policies import beat_slot_dropped, beat_slots_past_catchup
from .exceptions import NotInstalled

logger = logging.getLogger(__name__)

#: (metric name, help, signal, label taken from the signal's kwargs or None)
_COUNTERS: tuple[tuple[str, str, Any, str | None], ...] = (
    ("safe_time_beat_lease_acquired_total", "Times this beat became leader.", signals.beat_lease_acquired, None),
    ("safe_time_beat_lease_lost_total", "Times this beat lost the leader lease.", signals.beat_lease_lost, None),
    ("safe_time_beat_slots_dispatched_total", "Scheduled slots published.", signals.beat_slot_dispatched, "entry"),
    (
        "safe_time_beat_slots_suppressed_total",
        "Slots not published because already fired or the lease was gone.",
        signals.beat_slot_duplicate,
        "entry",
    ),
    (
        "safe_time_beat_slots_past_catchup_total",
        "Slots not published because they were later than their entry's catch-up window.",
        beat_slots_past_catchup,
        "entry",
    ),
    (
        "safe_time_beat_slots_dropped_total",
        "Slots not published because of their entry's overlap policy (a run was queued or running).",
        beat_slot_dropped,
        "entry",
    ),
    ("safe_time_delays_stored_total", "Long delays written to the store.", signals.delay_stored, "task_name"),
    (
        "safe_time_delays_debounced_total",
        "Debounced calls merged into their key's pending row (the burst's one run takes their arguments).",
        signals.delay_debounced,
        "task_name",
    ),
    ("safe_time_delays_released_total", "Stored delays published by the sweep.", signals.delay_released, "task_name"),
    ("safe_time_delays_cancelled_total", "Stored delays cancelled.", signals.delay_cancelled, None),
    ("safe_time_delays_failed_total", "Stored delays marked failed.", signals.delay_failed, "task_name"),
    (
        "safe_time_delay_deliveries_skipped_total",
        "Copies of stored deliveries dropped by the delivery record (already ran, cancelled, stale).",
        signals.delay_delivery_skipped,
        "reason",
    ),
    (
        "safe_time_overlap_conflicts_total",
        "Runs that found their overlap lock held.",
        signals.overlap_conflict,
        "action",
    ),
    ("safe_time_overlap_locks_lost_total", "Overlap locks lost while running.", signals.overlap_lock_lost, None),
    ("safe_time_idempotent_skipped_total", "Idempotent runs skipped.", signals.idempotent_skipped, None),
    (
        "safe_time_rate_limited_total",
        "Calls re-queued to a later place because their rate limit was full.",
        signals.rate_limited,
        "task_name",
    ),
)

#: How late rate-limited calls start: seconds from first finding the limit full to being admitted.
RATE_LATENESS = "safe_time_rate_limit_lateness_seconds"
_LATENESS_BUCKETS = (0.0, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0, 3600.0)

_counters: dict[str, Any] = {}
_receivers: list[tuple[Any, Any]] = []


def enable_metrics(registry: Any = None) -> dict[str, Any]:
    """Create the counters in ``registry`` (default: prometheus_client's) and connect them.

    Returns the counters by metric name. Calling it again is a no-op returning the same counters.
    """
    prometheus_client = _prometheus()
    if _counters:
        return dict(_counters)
    kwargs: dict[str, Any] = {} if registry is None else {"registry": registry}
    for name, doc, signal, label in _COUNTERS:
        counter = prometheus_client.Counter(name, doc, [label] if label else [], **kwargs)
        receiver = _receiver(counter, label)
        signal.connect(receiver, weak=False)
        _receivers.append((signal, receiver))
        _counters[name] = counter
    histogram = prometheus_client.Histogram(
        RATE_LATENESS,
        "Seconds a rate-limited call waited for its place (0 for calls admitted at once).",
        ["task_name"],
        buckets=_LATENESS_BUCKETS,
        **kwargs,
    )

    def observe(sender: Any = None, **fields: Any) -> None:
        histogram.labels(str(fields.get("task_name") or "unknown")).observe(float(fields.get("lateness") or 0.0))

    signals.rate_limit_admitted.connect(observe, weak=False)
    _receivers.append((signals.rate_limit_admitted, observe))
    _counters[RATE_LATENESS] = histogram
    logger.debug("celery-safe-time metrics enabled (%d counters)", len(_counters))
    return dict(_counters)


def disable_metrics() -> None:
    """Disconnect the counters (tests)."""
    for signal, receiver in _receivers:
        signal.disconnect(receiver)
    _receivers.clear()
    _counters.clear()


def _receiver(counter: Any, label: str | None) -> Any:
    def receive(sender: Any = None, **kwargs: Any) -> None:
        amount = kwargs.get("count", 1)  # a signal standing for several events says how many
        if label:
            counter.labels(str(kwargs.get(label) or "unknown")).inc(amount)
        else:
            counter.inc(amount)

    return receive


# --- gauges, computed on scrape -----------------------------------------------------------------

#: ``safe_time_overlap_locks_held`` counts at most this many (SCAN is linear in the keyspace).
LOCKS_COUNT_CAP = 10_000

GAUGES: dict[str, str] = {
    "safe_time_delays": "Stored delays per status (pending, claimed, sent, started, finished, failed, ...).",
    "safe_time_delay_oldest_due_lateness_seconds": "How far past due the oldest pending stored delay is "
    "(0 when none is overdue), by the store's clock.",
    "safe_time_delay_oldest_due_timestamp_seconds": "Due time of the oldest pending stored delay (absent when none).",
    "safe_time_beat_leader": "1 while a beat holds the leader lease (labels: its host and pid), else 0.",
    "safe_time_beat_lease_remaining_seconds": "Seconds left on the leader lease (0 when nobody holds it).",
    "safe_time_beat_epoch": "The leader lease's epoch (grows with every new leader).",
    "safe_time_beat_shard_leader": "Per shard of the runtime entries (safe_time_beat_shards; shard 0 alone with one): "
    "1 while a beat holds its lease (labels: shard, host, pid), else 0.",
    "safe_time_beat_shard_epoch": "Per shard: its lease's epoch (grows with every new holder).",
    "safe_time_beat_shard_scheduled": "Per shard: entries in its due set.",
    "safe_time_beat_shard_due": "Per shard: entries due now and not fired yet.",
    "safe_time_beat_shard_lag_seconds": "Per shard: how late its oldest due entry is (0 when none is overdue).",
    "safe_time_beat_beats": "Live sharded beats by their safe_time_beat_shards (label: shards); more than one "
    "value means the beats disagree (the later ones take no shard).",
    "safe_time_overlap_locks_held": f"Overlap and in-progress idempotent locks held (counted up to {LOCKS_COUNT_CAP}).",
    "safe_time_gauge_source_up": "1 when the collector could read the source (store, redis) at this scrape, else 0.",
    "safe_time_gauge_scrape_duration_seconds": "Time the collector took to read the store and Redis.",
}


class SafeTimeCollector:
    """A ``prometheus_client`` collector that reads one app's store and Redis at every scrape.

    A source that fails is reported as ``safe_time_gauge_source_up{source=...} 0`` with its gauges
    left out, never as an exception (a scrape must not fail because the store is down).
    """

    def __init__(self, app: Celery, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self._clock = clock

    def describe(self) -> list[Any]:
        # Describing by collecting would hit the store at registration; an empty list skips that check.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        started = self._clock()
        up = GaugeMetricFamily("safe_time_gauge_source_up", GAUGES["safe_time_gauge_source_up"], labels=["source"])
        families: list[Any] = []
        sources = (("store", "stored-delay", self._store_families), ("redis", "beat and lock", self._redis_families))
        for source, what, read in sources:
            try:
                families.extend(read(GaugeMetricFamily))
                up.add_metric([source], 1)
            except Exception as exc:  # a scrape reports a down source, it does not fail
                logger.warning("metrics: %s gauges unavailable: %s", what, exc)
                up.add_metric([source], 0)
        yield from families
        yield up
        yield _gauge(GaugeMetricFamily, "safe_time_gauge_scrape_duration_seconds", self._clock() - started)

    def _store_families(self, gauge: Any) -> list[Any]:
        from .delays.backends import get_store

        store = get_store(self.app)
        counts = store.counts()
        oldest = store.oldest_due(C.STATUS_PENDING)
        now = store.now()
        delays = gauge("safe_time_delays", GAUGES["safe_time_delays"], labels=["status"])
        for status in C.DELAY_STATUSES:
            delays.add_metric([status], counts.get(status, 0))
        lateness = max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0
        families = [delays, _gauge(gauge, "safe_time_delay_oldest_due_lateness_seconds", lateness)]
        if oldest is not None:
            families.append(_gauge(gauge, "safe_time_delay_oldest_due_timestamp_seconds", oldest.timestamp()))
        return families

    def _redis_families(self, gauge: Any) -> list[Any]:
        from .beat.backends import beat_backend
        from .config import get_config
        from .locks.backends import get_lock_backend

        config = get_config(self.app)
        backend = beat_backend(config)
        view = backend.lease_view()  # the beat backend's: Redis or PostgreSQL
        ttl_ms, epoch = view.ttl_ms, view.epoch
        held = ttl_ms is not None and ttl_ms > 0
        info = view.info if held else {}
        leader = gauge("safe_time_beat_leader", GAUGES["safe_time_beat_leader"], labels=["host", "pid"])
        leader.add_metric([str(info.get("host") or ""), str(info.get("pid") or "")], 1 if held else 0)
        remaining = ttl_ms / 1000.0 if ttl_ms is not None and held else 0.0
        families = [leader, _gauge(gauge, "safe_time_beat_lease_remaining_seconds", remaining)]
        if epoch:
            families.append(_gauge(gauge, "safe_time_beat_epoch", int(epoch)))
        families.extend(self._shard_families(gauge, backend))
        held_locks = len(get_lock_backend(self.app).scan(limit=LOCKS_COUNT_CAP))
        families.append(_gauge(gauge, "safe_time_overlap_locks_held", held_locks))
        return families

    def _shard_families(self, gauge: Any, backend: Any) -> list[Any]:
        """Every shard's holder, epoch, due set and lag, and the live beats by their K."""
        from .beat.admin import beat_rows, shard_rows

        def family(name: str, labels: list[str]) -> Any:
            return gauge(name, GAUGES[name], labels=labels)

        leader = family("safe_time_beat_shard_leader", ["shard", "host", "pid"])
        epoch = family("safe_time_beat_shard_epoch", ["shard"])
        scheduled = family("safe_time_beat_shard_scheduled", ["shard"])
        due = family("safe_time_beat_shard_due", ["shard"])
        lag = family("safe_time_beat_shard_lag_seconds", ["shard"])
        for row in shard_rows(backend):
            shard = str(row["shard"])
            held = row["lease_left_s"] is not None
            leader.add_metric(
                [shard, str(row["host"] or "") if held else "", str(row["pid"] or "") if held else ""], int(held)
            )
            epoch.add_metric([shard], int(row["epoch"] or 0))
            scheduled.add_metric([shard], row["scheduled"])
            due.add_metric([shard], row["due_now"])
            lag.add_metric([shard], row["lag_s"])
        beats = family("safe_time_beat_beats", ["shards"])
        counts = collections.Counter(b["shards_setting"] for b in beat_rows(backend))
        counts.setdefault(backend.config.beat_shards, 0)  # this app's K, also while no beat is alive
        for shards, count in sorted(counts.items()):
            beats.add_metric([str(shards)], count)
        return [leader, epoch, scheduled, due, lag, beats]


def _gauge(gauge: Any, name: str, value: float) -> Any:
    """The unlabelled gauge ``name`` (help from :data:`GAUGES`) holding ``value``."""
    family = gauge(name, GAUGES[name])
    family.add_metric([], value)
    return family


def register_gauges(app: Celery, registry: Any = None) -> SafeTimeCollector:
    """Register the gauges of ``app`` in ``registry`` (default: prometheus_client's); returns the collector."""
    prometheus_client = _prometheus()
    collector = SafeTimeCollector(app)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise NotInstalled("metrics need prometheus-client: pip install 'celery-safe-time[metrics]'") from exc
    return prometheus_client
