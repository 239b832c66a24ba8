"""What differs between the Celery and kombu versions the package supports (Celery 5.4 through 5.7).

The one place that knows: the rest of the package imports these names from here and never checks a
version itself. Each fallback behaves as the newer library does where the package relies on it:

- :class:`BatchPublishError` (kombu 5.7): older kombu never batches a publish, so nothing raises the
  stand-in and an ``except`` naming it is inert there.
- :func:`subtract_datetimes` (Celery 5.7), :func:`detect_quorum_queues` (Celery 5.5; 5.4 has no native
  delayed delivery on quorum queues, so the stand-in answers "no").
- :func:`push_request` (Celery 5.5): on Celery 5.4 ``Task.__call__`` pushes a bare request (only args
  and kwargs), so a task class with its own ``__call__`` (SafeTask) would run its body with no task id,
  no retries count and no headers: ``self.retry()`` then raises instead of retrying.
- :func:`routable_eta` / :func:`routable_countdown` (Celery 5.5+ on quorum queues): native delayed
  delivery routes a delay by its whole seconds and raises ``ValueError`` for one under a second
  (kombu's ``calculate_routing_key``); these move such a delay to the shortest one it routes.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from celery.app.task import Context
from kombu.exceptions import KombuError

__all__ = [
    "BatchPublishError",
    "detect_quorum_queues",
    "native_delayed_delivery",
    "push_request",
    "routable_countdown",
    "routable_eta",
    "subtract_datetimes",
]

#: The shortest delay native delayed delivery routes: it sends ``int(countdown)`` seconds and refuses 0.
NATIVE_DELAY_MIN = 1.0
#: An eta is turned into a countdown again inside ``send_task``, a moment later: the margin keeps that
#: countdown at or above :data:`NATIVE_DELAY_MIN`.
NATIVE_DELAY_ETA_MARGIN = 0.25

try:
    from kombu.exceptions import BatchPublishError
except ImportError:  # kombu < 5.7

    class BatchPublishError(KombuError):  # type: ignore[no-redef]
        """Raised by kombu 5.7+ when a batched publish fails; older kombu never batches, never raises it."""


try:
    from celery.utils.time import subtract_datetimes
except ImportError:  # Celery < 5.7

    def subtract_datetimes(end: datetime, start: datetime) -> timedelta:
        """``end - start``, a naive datetime taken as UTC (Celery 5.7's ``subtract_datetimes``)."""
        return _utc(end) - _utc(start)

    def _utc(moment: datetime) -> datetime:
        if moment.tzinfo is None:
            return moment.replace(tzinfo=timezone.utc)
        return moment.astimezone(timezone.utc)


def detect_quorum_queues(app: Any, driver_type: str) -> tuple[bool, str]:
    """Celery's ``detect_quorum_queues``: whether ``app`` uses quorum queues, and the name of the first.

    On Celery 5.4 (no such helper, no native delayed delivery for them) the answer is ``(False, "")``.
    """
    try:
        from celery.utils.quorum_queues import detect_quorum_queues as detect
    except ImportError:  # Celery < 5.5
        return False, ""
    found, name = detect(app, driver_type)
    return bool(found), str(name)


def push_request(task: Any, *args: Any, **kwargs: Any) -> None:
    """Push a request on ``task``'s stack that inherits the running request (Celery 5.5+'s behaviour)."""
    task.request_stack.push(Context(*args, **{**task.request.__dict__, **kwargs}))


def native_delayed_delivery(app: Any, driver_type: str) -> bool:
    """Whether ``app.send_task`` routes a delay through the broker's delayed-delivery exchanges (quorum queues)."""
    return detect_quorum_queues(app, driver_type)[0]


def routable_countdown(app: Any, countdown: float) -> float:
    """``countdown`` as ``app.send_task`` can publish it: under native delayed delivery, one under a
    second becomes one second; otherwise (and for any other broker) unchanged."""
    if not 0 < countdown < NATIVE_DELAY_MIN:
        return countdown
    driver_type = app.producer_pool.connections.connection.transport.driver_type  # as send_task finds it
    return NATIVE_DELAY_MIN if native_delayed_delivery(app, driver_type) else countdown


def routable_eta(eta: datetime, now: datetime) -> datetime:
    """``eta`` as native delayed delivery can route it, seen at ``now``: one less than a second ahead moves
    to 1.25 s ahead (late by under 1.25 s, never early); a past or farther one is unchanged."""
    ahead = subtract_datetimes(eta, now).total_seconds()
    if 0 < ahead < NATIVE_DELAY_MIN + NATIVE_DELAY_ETA_MARGIN:
        return now + timedelta(seconds=NATIVE_DELAY_MIN + NATIVE_DELAY_ETA_MARGIN)
    return eta
