"""Optional Prometheus metrics (``pip install celery-safe-time[metrics]``).

``enable_metrics()`` connects counters to :mod:`celery_safe_time.signals` in this process;
expose them the usual way (``prometheus_client.start_http_server(9808)`` in the worker/beat,
or the multiprocess collector for prefork workers). Gauges that need a query (pending delays,
oldest due, held locks) come from ``celery safe-time status --json``, which is cheap to scrape.
"""

from __future__ import annotations

import logging
from typing import Any

from . import signals
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
    ("safe_time_delays_stored_total", "Long delays written to the store.", signals.delay_stored, "task_name"),
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
)

_counters: dict[str, Any] = {}
_receivers: list[tuple[Any, Any]] = []


def enable_metrics(registry: Any = None) -> dict[str, Any]:
    """Create the counters in ``registry`` (default: prometheus_client's) and connect them.

    Returns the counters by metric name. Calling it again is a no-op returning the same counters.
    """
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise NotInstalled("metrics need prometheus-client: pip install 'celery-safe-time[metrics]'") from exc
    if _counters:
        return dict(_counters)
    kwargs: dict[str, Any] = {} if registry is None else {"registry": registry}
    for name, doc, signal, label in _COUNTERS:
        counter = prometheus_client.Counter(name, doc, [label] if label else [], **kwargs)
        receiver = _receiver(counter, label)
        signal.connect(receiver, weak=False)
        _receivers.append((signal, receiver))
        _counters[name] = counter
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
        if label:
            counter.labels(str(kwargs.get(label) or "unknown")).inc()
        else:
            counter.inc()

    return receive
