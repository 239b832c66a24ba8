"""Where a gate's waiting call goes, for every task: the broker for a short wait, the store for a long one.

A gate that cannot admit a delivery now sends the same message again later
(:func:`~celery_safe_time.locks.runtime.requeue`); :func:`send_later` routes that copy by
:func:`~celery_safe_time.messages.requeue.wait_route`: a broker countdown up to
``safe_time_delay_threshold``, a store row beyond it (without the sweep: a countdown of the threshold,
and it waits again from there). The copy keeps the task id, retries and headers: the same call.
A plain task has no delivery check of its own, so :func:`checked_delivery` (run by every gate's
wrapper) does it for the first gate the delivery meets.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from celery import Task
from celery._state import get_current_task
from celery.canvas import Signature
from celery.utils import uuid

from ..clock import as_utc
from ..config import get_config
from ..exceptions import StoreError
from ..install_check import not_installed_message, rows_are_sent
from ..messages.compat import routable_countdown
from ..messages.requeue import wait_route
from .backends import get_store
from .backends.base import NewDelay
from .delivery import delivery_token, run_delivery
from .payload import DELIVERY_HEADERS, encode_call, strip_delivery_headers

logger = logging.getLogger(__name__)

__all__ = ["checked_delivery", "send_later"]

R = TypeVar("R")

#: Apps told once that their long waits hop through the broker (no sweep installed).
_warned_no_sweep: weakref.WeakSet[Any] = weakref.WeakSet()
#: Set on a request once its delivery token was checked, so a second gate of the same delivery runs on.
_CHECKED_ATTR = "_safe_time_delivery_checked"


def send_later(task: Task, sig: Signature, countdown: float) -> None:
    """Publish ``sig`` (a signature of ``task``, with its task id) ``countdown`` seconds from now:
    through the broker at or below the delay threshold, else as a row of the store."""
    app = task._get_app()
    # The copy is another delivery: the stored row's token it came with is spent once this run ends.
    strip_delivery_headers(sig.options)
    threshold = get_config(app).delay_threshold
    if wait_route(countdown, threshold) == "broker" or stores_its_delays(task):
        # A SafeTask's own apply_async sends a countdown beyond the threshold to the store, with its
        # unique key and its options: the same rule, already applied.
        sig.apply_async(countdown=routable_countdown(app, countdown))
        return
    if not rows_are_sent(app):
        # Nothing would ever send a stored row: come back at the threshold instead, and wait again
        # from there (the gate keeps the call's place: a rate reservation's token travels with it).
        _warn_no_sweep(app, task.name)
        sig.apply_async(countdown=routable_countdown(app, threshold))
        return
    try:
        store_call(task, sig, countdown)
    except StoreError as exc:
        # The store is down: the call must not be lost with it. It comes back at the threshold and
        # waits again from there, as without the sweep.
        logger.warning(
            "could not store the %.1fs wait of %s[%s] (%s); it comes back in %.1fs instead",
            countdown,
            task.name,
            sig.options.get("task_id"),
            exc,
            threshold,
        )
        sig.apply_async(countdown=routable_countdown(app, threshold))


def _warn_no_sweep(app: Any, task_name: str) -> None:
    if app in _warned_no_sweep:
        return
    _warned_no_sweep.add(app)
    logger.warning(
        "%s waits longer than safe_time_delay_threshold, which belongs in the store, but %s; it comes back "
        "after the threshold and waits again, one broker round trip per threshold",
        task_name,
        not_installed_message(app),
    )


def stores_its_delays(task: Any) -> bool:
    """Whether ``task`` (a ``SafeTask``) routes its long countdowns and checks its deliveries itself."""
    return bool(getattr(task, "safe_time_stores_delays", False))


def store_call(task: Task, sig: Signature, countdown: float) -> None:
    """Write ``sig`` as a pending row due ``countdown`` seconds from the store's now, under its task id."""
    app = task._get_app()
    config = get_config(app)
    options = dict(sig.options)
    task_id = options.pop("task_id", None) or uuid()
    expires = options.pop("expires", None)
    serializer = options.get("serializer") or task.serializer or app.conf.task_serializer
    encoded = encode_call(sig.args, sig.kwargs, options, serializer, allow_pickle=config.allow_pickle)
    new = NewDelay(
        id=task_id,
        task=task.name,
        payload=encoded.payload,
        content_type=encoded.content_type,
        content_encoding=encoded.content_encoding,
        countdown=countdown,
        expires_at=_expires_at(expires),
    )
    result = get_store(app).insert(new)
    logger.debug("stored the wait of %s[%s]: due at %s", task.name, task_id, result.due_at)


def _expires_at(expires: Any) -> datetime | None:
    """The absolute expiry a re-queued message carries (Celery sends it as an ISO 8601 string)."""
    if expires is None or isinstance(expires, (int, float)):
        # A relative expires was made absolute when the call was first sent; a number here is none.
        return None
    return as_utc(expires)


def checked_delivery(body: Callable[[], R]) -> R:
    """Run ``body`` (a gate and the task body behind it) once the store says this delivery may start,
    when it is a stored row's delivery of a task that does not check it itself; else run it as is."""
    task = get_current_task()
    if task is None or stores_its_delays(task):
        return body()
    request = task.request
    if request is None or request.called_directly or getattr(request, _CHECKED_ATTR, False):
        return body()
    token = delivery_token(request)
    if token is None:
        return body()
    setattr(request, _CHECKED_ATTR, True)

    def started() -> R:
        # The row's delivery has started: whatever the body publishes from its request is a new
        # delivery (``retry()`` copies the request's headers), never this row's, which ends with this
        # run; with the token the retried message would be dropped as this finished delivery.
        headers = getattr(request, "headers", None)
        if headers and not DELIVERY_HEADERS.isdisjoint(headers):
            request.headers = {k: v for k, v in headers.items() if k not in DELIVERY_HEADERS}
        return body()

    return run_delivery(task, token, started)
