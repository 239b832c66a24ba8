"""``SafeTask``: a Task base class whose long countdowns/etas go to a durable store, not the broker.

A countdown or eta beyond ``safe_time_delay_threshold`` becomes one row in the store; the sweep
publishes it, with its own task id and ``eta=due_at``, shortly before it is due. Everything else
(short delays, immediate calls, eager mode) is plain ``Task.apply_async``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.result import AsyncResult
from celery.utils import uuid

from .. import constants as C
from .. import signals
from ..clock import as_utc, local_time, to_datetime
from ..config import get_config
from ..tracing import inject_context
from .delivery import delivery_token, run_delivery
from .install_check import warn_once_if_not_installed
from .payload import clean_options, encode
from .plan import plan_delay
from .stores import get_store
from .stores.base import NewDelay

logger = logging.getLogger(__name__)

__all__ = ["SafeTask", "StoredAsyncResult"]

#: Headers of one delivery of a stored row: a retry or a new call is a new delivery and must not carry them.
_INTERNAL_HEADERS = frozenset({C.HEADER_STORED, C.HEADER_DELIVERY, C.HEADER_PRIOR_RUNS})


class StoredAsyncResult(AsyncResult):
    """An ``AsyncResult`` whose ``revoke()`` also cancels the stored row (durably)."""

    def revoke(
        self,
        connection: Any = None,
        terminate: bool = False,
        signal: Any = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> None:
        from .admin import cancel

        cancel(self.id, app=self.app)
        # Still broadcast: the row may have been published already (inside the sweep's look-ahead).
        super().revoke(connection=connection, terminate=terminate, signal=signal, wait=wait, timeout=timeout)


class SafeTask(Task):
    """Use as ``@app.task(base=SafeTask)`` or ``Celery(..., task_cls='celery_safe_time:SafeTask')``.

    Extra ``apply_async`` option: ``idempotency_key=`` (stored delays only): while a pending row
    holds the key, another call returns that row's task id and stores nothing.
    """

    def AsyncResult(self, task_id: str, **kwargs: Any) -> StoredAsyncResult:
        return StoredAsyncResult(task_id, backend=self.backend, task_name=self.name, app=self._get_app(), **kwargs)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        idempotency_key = options.pop(C.OPTION_IDEMPOTENCY_KEY, None)
        headers = options.get("headers")
        if headers and any(h in headers for h in _INTERNAL_HEADERS):
            # retry() copies the running request's headers: a retried stored task must not
            # look like the sweep's delivery of the original, or the delivery check would skip it.
            options["headers"] = {k: v for k, v in headers.items() if k not in _INTERNAL_HEADERS}
        app = self._get_app()
        if app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        config = get_config(app)
        plan = plan_delay(
            options.get("countdown"),
            options.get("eta"),
            now=to_datetime(local_time()),
            threshold=config.delay_threshold,
        )
        if plan is None:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

        # The same argument checks and option merging plain apply_async does, then store.
        if self.typing:
            header = getattr(self, "__header__", None)
            if header is not None:
                header(*(args or ()), **(kwargs or {}))
        shadow = shadow or self.shadow_name(args, kwargs, options)
        options = dict(self._get_exec_options(), **options)
        options.setdefault("ignore_result", self.ignore_result)
        add_to_parent = options.get("add_to_parent", True)
        parent = app.current_worker_task
        if parent is not None:
            options.setdefault("root_id", parent.request.root_id or parent.request.id)
            options.setdefault("parent_id", parent.request.id)
        if shadow:
            options["shadow"] = shadow
        if link:
            options["link"] = [dict(s) for s in _as_list(link)]
        if link_error:
            options["link_error"] = [dict(s) for s in _as_list(link_error)]
        # Nothing is published now, so no publish hook carries the caller's trace: the row must.
        options["headers"] = inject_context(options.get("headers"))
        serializer = options.get("serializer") or self.serializer or app.conf.task_serializer
        body = {
            "args": list(args or ()),
            "kwargs": dict(kwargs or {}),
            "options": clean_options(options, _INTERNAL_HEADERS),
        }
        encoded = encode(body, serializer, allow_pickle=config.allow_pickle)

        expires = options.get("expires")
        expires_in = float(expires) if isinstance(expires, (int, float)) and not isinstance(expires, bool) else None
        task_id = task_id or uuid()
        result = get_store(app).insert(
            NewDelay(
                id=task_id,
                task=self.name,
                payload=encoded.payload,
                content_type=encoded.content_type,
                content_encoding=encoded.content_encoding,
                due_at=plan.eta,
                countdown=plan.countdown,
                # Relative expires counts from the call, on the store's clock like the countdown.
                expires_at=None if expires is None or expires_in is not None else as_utc(expires),
                expires_in=expires_in,
                idempotency_key=idempotency_key,
            )
        )
        due_at = result.due_at
        warn_once_if_not_installed(app)
        if result.created:
            logger.debug("stored %s[%s] due at %s", self.name, task_id, due_at)
            signals.delay_stored.send(sender=self, task_id=task_id, task_name=self.name, due_at=due_at)
        else:
            logger.debug("idempotency key %r already pending as %s", idempotency_key, result.task_id)
        async_result = self.AsyncResult(result.task_id)
        if add_to_parent and parent is not None and result.created:
            parent.add_trail(async_result)
        return async_result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if not request.called_directly:
            token = delivery_token(request)
            if token is not None:
                call = super().__call__
                return run_delivery(self, token, lambda: call(*args, **kwargs))
            if (request.headers or {}).get(C.HEADER_STORED):
                # Published by a sweep from before the delivery record: nothing to check it against.
                logger.warning("running stored task %s[%s] published without a delivery token", self.name, request.id)
        return super().__call__(*args, **kwargs)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
