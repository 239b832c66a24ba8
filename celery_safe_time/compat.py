"""What differs between the Celery and kombu versions the package supports (Celery 5.4 through 5.7).

The one place that knows: the rest of the package imports these names from here and never checks a
version itself. Each fallback behaves as the newer library does where the package relies on it.

- :class:`BatchPublishError` (kombu 5.7): raised by kombu's Redis transport when a batched publish's
  pipeline fails. Older kombu has no batched publish (``Producer.supports_batch_publish`` is absent,
  so :func:`~celery_safe_time.publishing.batched_publish` publishes message by message) and never
  raises it; the stand-in is a :class:`~kombu.exceptions.KombuError` nothing raises, so an
  ``except`` naming it is inert there.
- :func:`subtract_datetimes` (Celery 5.7): the time between two datetimes, naive ones taken as UTC.
- :func:`detect_quorum_queues` (Celery 5.5): whether the app's queues are quorum queues on a
  transport that supports them. Celery 5.4 has no native delayed delivery on quorum queues, so the
  stand-in answers "no".
- :func:`push_request` (Celery 5.5): ``Task.push_request`` as Celery 5.5+ has it, the new request
  inheriting the running one. On Celery 5.4 ``Task.__call__`` pushes a bare request (only args and
  kwargs), so a task class with its own ``__call__`` (SafeTask) runs its body with no task id, no
  retries count and no headers: ``self.retry()`` then raises instead of retrying.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from celery.app.task import Context
from kombu.exceptions import KombuError

__all__ = ["BatchPublishError", "detect_quorum_queues", "push_request", "subtract_datetimes"]

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
