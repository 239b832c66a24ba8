"""The worker-side delivery check of stored tasks: run a stored delivery once, never unchecked.

The sweep publishes each row once outside a crash window; a second delivery of the same stored
task id (at the same retry count) is recognised here and skipped.
"""

from __future__ import annotations

import logging

from celery import Task
from celery.exceptions import Retry

from .. import constants as C
from ..config import get_config
from ..redis_client import get_redis
from ..requeue import jittered

logger = logging.getLogger(__name__)


def first_delivery(task: Task) -> bool:
    """Record that this stored task id (at this retry count) started; False if it already had.

    The store publishes each row once outside a crash window; this closes the window (a sweeper
    killed after publishing, before marking the row sent, lets another sweeper publish it again).
    Raises ``redis.RedisError`` when the check's Redis cannot answer.
    """
    config = get_config(task._get_app())
    request = task.request
    key = config.key(C.KEY_TASK_DONE, task_id=f"{request.id}:{request.retries or 0}")
    return bool(get_redis(config.redis_url).set(key, request.hostname or "1", nx=True, ex=C.DELIVERY_GUARD_TTL))


def requeue_unchecked(task: Task, exc: Exception) -> None:
    """Send this delivery again in a few seconds instead of running it without the check.

    Running unchecked is what turned one crash window into hundreds of repeats in the soak (a
    re-published row ran again while the check's Redis restarted). The copy keeps the task id,
    the retry count and the stored header, so it is checked like the original. Only when
    the copy cannot be published either (the broker is down too) does the task run unchecked:
    the message is already off the queue, and losing it would be worse than a possible repeat.
    """
    request = task.request
    countdown = jittered(C.DELIVERY_GUARD_RETRY_AFTER, C.DELIVERY_GUARD_RETRY_JITTER)
    sig = task.signature_from_request(request, countdown=countdown)
    try:
        # Task.apply_async, not SafeTask's: that one strips the stored header from retries.
        Task.apply_async(task, sig.args, sig.kwargs, **sig.options)
    except Exception as publish_error:
        logger.warning(
            "delivery check unavailable for stored task %s[%s] (%s) and re-queueing failed (%s): running it",
            task.name,
            request.id,
            exc,
            publish_error,
        )
        return
    logger.warning(
        "delivery check unavailable for stored task %s[%s], re-queued in %.1fs: %s",
        task.name,
        request.id,
        countdown,
        exc,
    )
    raise Retry(exc=exc, when=countdown, sig=sig)
