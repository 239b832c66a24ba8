"""``SafeTask``: a Task base class whose long countdowns/etas go to a durable store, not the broker.

A countdown or eta beyond ``safe_time_delay_threshold`` becomes one row in the store; the sweep
publishes it, with its own task id and ``eta=due_at``, shortly before it is due. Everything else
(short delays, immediate calls, eager mode) is plain ``Task.apply_async``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from celery import Task
from celery.result import AsyncResult
from celery.utils import uuid

from .. import constants as C
from .. import signals
from ..clock import as_utc, local_time, to_datetime
from ..config import expires_argument, get_config
from ..exceptions import BulkItemError, DebounceError, StoreError
from ..install_check import warn_once_if_not_installed
from ..locks import unique as unique_tasks
from ..locks.backends import get_lock_backend
from ..locks.keys import KeySpec
from ..locks.limits import LimitSpec, RateSpec
from ..locks.task_options import apply_flow_options, original_run
from ..messages.compat import push_request
from .backends import get_store
from .backends.base import InsertResult, NewDelay
from .debounce import caller_idempotency_key, debounce_call, unique_row_key
from .delivery import delivery_token, run_delivery
from .payload import encode_call, strip_delivery_headers
from .plan import DelayPlan, check_call_times, plan_delay
from .sqs import check_message_size
from .tracing import inject_context

logger = logging.getLogger(__name__)

__all__ = ["SafeTask", "StoredAsyncResult"]

#: The options of a debounced call (:mod:`.debounce`).
_DEBOUNCE_OPTIONS = (C.OPTION_DEBOUNCE, C.OPTION_DEBOUNCE_KEY, C.OPTION_DEBOUNCE_MAX_WAIT)


class StoredAsyncResult(AsyncResult):
    """An ``AsyncResult`` whose ``revoke()`` cancels the stored row (durably) when it has not started."""

    def revoke(
        self,
        connection: Any = None,
        terminate: bool = False,
        signal: Any = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> None:
        from .admin import cancel

        if cancel(self.id, app=self.app):
            # Cancelled before it started, and recorded REVOKED: a message already out for it is
            # dropped by the delivery check wherever it arrives. A broadcast would make the worker
            # that holds it record it (and count its chord part) a second time.
            return
        # Not a stored call, or one that has started: Celery's revoke (terminate= reaches a running one).
        super().revoke(connection=connection, terminate=terminate, signal=signal, wait=wait, timeout=timeout)


class SafeTask(Task):
    """Use as ``@app.task(base=SafeTask)`` or ``Celery(..., task_cls='celery_safe_time:SafeTask')``.

    Extra ``apply_async`` options: ``idempotency_key=`` (stored delays only): while a pending row of
    the same task holds the key, another call returns that row's task id and stores nothing (the row
    holds ``caller:<task>:<key>``). ``debounce=`` (a
    ``timedelta`` or seconds), ``debounce_key=`` (a template over the task's arguments, or a callable)
    and ``debounce_max_wait=``: the call is stored due ``debounce`` from now; a later call with the same
    key while that row is pending moves it to ``debounce`` from its own time, never past the first call
    plus ``debounce_max_wait``, and replaces its arguments (one run per burst). Extra task options:
    ``unique=``, ``unique_until=``, ``unique_ttl=``, ``unique_on_conflict=`` (:mod:`..locks.unique`);
    ``safe_time_rate_limit=``, ``safe_time_rate_key=``, ``safe_time_concurrency_limit=``,
    ``safe_time_concurrency_key=`` (:mod:`..locks.task_options`).
    """

    #: Unique tasks (``@app.task(base=SafeTask, unique="export:{user_id}")``): a key template over the
    #: task's parameters (or a callable); while a queued, stored or running copy holds the key, another
    #: call returns that copy (``unique_on_conflict="return"``) or raises ``UniqueConflict`` ("raise").
    unique: KeySpec | None = None
    #: ``"executing"`` (free once it starts), ``"executed"`` (once it ends) or ``"expired"`` (only the ttl).
    unique_until: str = C.DEFAULT_UNIQUE_UNTIL
    #: Seconds the key outlives a holder that never frees it (kill -9, a lost message).
    unique_ttl: float = C.DEFAULT_UNIQUE_TTL
    unique_on_conflict: str = C.DEFAULT_UNIQUE_ON_CONFLICT
    #: Flow control across every worker (``rate_limit`` and ``concurrency_limit`` as task options): a
    #: rate such as ``"100/m"`` (or a callable of the task's arguments returning one), per key of
    #: ``safe_time_rate_key`` (a template over the task's parameters, or a callable; default: one key,
    #: the task's name). Unlike Celery's ``rate_limit`` it holds across workers, not in each one.
    safe_time_rate_limit: RateSpec | None = None
    safe_time_rate_key: KeySpec | None = None
    #: At most this many calls per key of ``safe_time_concurrency_key`` run at once (an int of at
    #: least 1, or a callable of the task's arguments returning one).
    safe_time_concurrency_limit: LimitSpec | None = None
    safe_time_concurrency_key: KeySpec | None = None
    #: Its long countdowns go to the store and its stored deliveries are checked in ``__call__``: a
    #: gate's long wait is one of its own countdowns (:mod:`.waits`).
    safe_time_stores_delays: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery builds the task class from the decorator's options: a bad unique= fails here,
        # when the task is created, not at the first delay() in production.
        super().__init_subclass__(**kwargs)
        run = _unique_run_attr(cls)
        spec = None
        if run is not None:
            name = str(cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}")
            # The unique key binds the task's own function (a flow option's wrapper keeps its signature).
            spec = unique_tasks.unique_spec(
                name, original_run(run), cls.unique, cls.unique_until, cls.unique_ttl, cls.unique_on_conflict
            )
            apply_flow_options(cls, name, run)
        setattr(cls, unique_tasks.SPEC_ATTR, spec)

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
        call = _Call(args, kwargs, options, task_id, producer, link, link_error, shadow)
        if _debounced(options):
            return self._apply_debounced(call)
        for name in _DEBOUNCE_OPTIONS:
            if options.pop(name, None) is not None:
                raise DebounceError(f"task {self.name}: {name}= needs debounce= (the quiet period)")
        idempotency_key = caller_idempotency_key(self.name, options.pop(C.OPTION_IDEMPOTENCY_KEY, None))
        # retry() copies the running request's headers: a retried stored task must not
        # look like the sweep's delivery of the original, or the delivery check would skip it.
        call = dataclasses.replace(call, options=strip_delivery_headers(options), idempotency_key=idempotency_key)
        app = self._get_app()
        # Checked in eager mode too: a bad countdown fails in tests as it would in production.
        check_call_times(options.get("countdown"), options.get("eta"), options.get("expires"))
        if app.conf.task_always_eager:
            return self._publish(call)
        config = get_config(app)
        now = to_datetime(local_time())
        plan = plan_delay(options.get("countdown"), options.get("eta"), now=now, threshold=config.delay_threshold)
        spec = unique_tasks.spec_of(self)
        if spec is not None:
            return self._apply_unique(spec, plan, now, call)
        if plan is None:
            return self._publish(call)
        return self._store(call, plan)[0]

    def _publish(self, call: _Call) -> Any:
        """Celery's own ``apply_async`` of the call: the broker, or eager mode's run in place."""
        return super().apply_async(
            call.args, call.kwargs, call.task_id, call.producer, call.link, call.link_error, call.shadow, **call.options
        )

    def _apply_debounced(self, call: _Call) -> Any:
        """Store the call as its key's debounced row: a new row, or the pending one moved and replaced."""
        app = self._get_app()
        config = get_config(app)
        if unique_tasks.spec_of(self) is not None:
            raise DebounceError(f"task {self.name}: a unique task cannot be debounced (both decide the one copy)")
        options = call.options
        debounce = debounce_call(
            self.name,
            _unique_run_attr(type(self)),
            type(self),
            options,
            call.args,
            call.kwargs,
            sweep_interval=config.sweep_interval,
        )
        for name in _DEBOUNCE_OPTIONS:
            options.pop(name, None)
        call = dataclasses.replace(call, options=strip_delivery_headers(options), idempotency_key=debounce.stored_key)
        if app.conf.task_always_eager:
            # Eager mode runs every call at once: nothing waits, so nothing merges.
            return self._publish(call)
        delay = self._stored_delay(app, config, call, DelayPlan(countdown=debounce.period))
        new = dataclasses.replace(delay.new, debounce_max_wait=debounce.max_wait)
        result = get_store(app).debounce(new)
        if not result.created:
            logger.debug("debounced %s[%s] (%s) moved to %s", self.name, result.task_id, debounce.key, result.due_at)
            signals.delay_debounced.send(
                sender=self, task_id=result.task_id, task_name=self.name, key=debounce.key, due_at=result.due_at
            )
        return self._stored_result(app, dataclasses.replace(delay, new=new), result)

    def _apply_unique(self, spec: unique_tasks.UniqueSpec, plan: DelayPlan | None, now: datetime, call: _Call) -> Any:
        """Take the task's unique key, then publish or store; a held key hands back its holder."""
        app = self._get_app()
        key = spec.render(call.args, call.kwargs)
        task_id = call.task_id or uuid()
        parent = app.current_worker_task
        # retry() (and a lock re-queue) publishes under the running task's own id: that is the
        # holder continuing, never a conflict.
        own = parent is not None and parent.request.id == task_id
        ttl = spec.ttl + _delay_seconds(plan, call.options, now)
        found = unique_tasks.claim(app, key, task_id, ttl, stored=plan is not None, own=own)
        if found.status == "held":
            return unique_tasks.conflict(self, spec, key, found.holder or task_id, found.state)
        options = call.options
        options["headers"] = {**(options.get("headers") or {}), C.HEADER_UNIQUE: key}
        try:
            if plan is None:
                return self._publish(dataclasses.replace(call, task_id=task_id))
            # Stored: the unique key is also the row's idempotency key (in its own prefix, out of
            # callers' reach), so the store itself refuses a second pending row for it even if the lock
            # backend forgot the key.
            result, created = self._store(
                dataclasses.replace(call, task_id=task_id, idempotency_key=call.idempotency_key or unique_row_key(key)),
                plan,
            )
        except BaseException:
            if found.status == "acquired":
                unique_tasks.release(get_lock_backend(app), key, task_id, "not queued")
            raise
        if result.id == task_id or created:
            return result
        if call.idempotency_key is not None:
            # The caller's own idempotency key matched another pending row: the result is that row's.
            unique_tasks.release(get_lock_backend(app), key, task_id, "idempotency key already pending")
            return result
        unique_tasks.repoint(app, key, task_id, result.id, ttl)
        return unique_tasks.conflict(self, spec, key, result.id, C.UNIQUE_STATE_STORED)

    def _store(self, call: _Call, plan: DelayPlan) -> tuple[StoredAsyncResult, bool]:
        """Write the call as one row of the store; returns its AsyncResult and whether it is new."""
        app = self._get_app()
        delay = self._stored_delay(app, get_config(app), call, plan)
        result = get_store(app).insert(delay.new)
        return self._stored_result(app, delay, result), result.created

    def apply_many(self, calls: Iterable[Any]) -> list[Any]:
        """Schedule many calls at once: ``[(args, kwargs, options), ...]`` (``kwargs``/``options`` optional).

        The stored delays of the batch are written in one store transaction (one round trip per few
        thousand rows instead of one transaction per call); calls with a short delay or none go to the
        broker as usual once they are stored. ``options`` are ``apply_async``'s, ``idempotency_key``
        and ``task_id`` included, and behave as for single calls (a key held by a pending row, or by an
        earlier call of the same batch, returns that row's id and stores nothing). A bad call (wrong
        shape, arguments the serializer refuses, a task id already pending) raises the error a single
        call would raise, naming its index (``exc.index``), and nothing of the batch is stored or sent.
        Returns one result per call, in order.
        """
        app = self._get_app()
        prepared: list[tuple[Any, Any, dict[str, Any]]] = []
        for index, item in enumerate(calls):
            try:
                prepared.append(_unpack_call(item))
                options = prepared[-1][2]
                check_call_times(options.get("countdown"), options.get("eta"), options.get("expires"))
            except (TypeError, ValueError) as exc:
                raise _at_index(exc, index) from exc
        if app.conf.task_always_eager or unique_tasks.spec_of(self) is not None:
            # A unique task takes its key in Redis call by call (a held key hands back its holder),
            # so its batch is so many single calls.
            return [self.apply_async(args, kwargs, **options) for args, kwargs, options in prepared]
        config = get_config(app)
        now = to_datetime(local_time())
        stored: list[tuple[int, _StoredDelay]] = []
        sent: list[tuple[int, Any, Any, dict[str, Any]]] = []
        for index, (args, kwargs, options) in enumerate(prepared):
            options = dict(options)
            try:
                # A debounced call merges into its key's row, one call at a time (apply_async).
                debounced = _debounced(options)
                plan = (
                    None
                    if debounced
                    else plan_delay(
                        options.get("countdown"), options.get("eta"), now=now, threshold=config.delay_threshold
                    )
                )
                if plan is None:
                    if not debounced:
                        caller_idempotency_key(self.name, options.pop(C.OPTION_IDEMPOTENCY_KEY, None))
                    sent.append((index, args, kwargs, options))
                    continue
                call = _Call(
                    args,
                    kwargs,
                    options,
                    task_id=options.pop("task_id", None),
                    link=options.pop("link", None),
                    link_error=options.pop("link_error", None),
                    shadow=options.pop("shadow", None),
                    idempotency_key=caller_idempotency_key(self.name, options.pop(C.OPTION_IDEMPOTENCY_KEY, None)),
                )
                delay = self._stored_delay(
                    app, config, dataclasses.replace(call, options=strip_delivery_headers(options)), plan
                )
            except (TypeError, ValueError) as exc:  # SerializationError is a TypeError
                raise _at_index(exc, index) from exc
            stored.append((index, delay))
        results: list[Any] = [None] * len(prepared)
        if stored:
            try:
                inserted = get_store(app).insert_many([delay.new for _, delay in stored])
            except StoreError as exc:
                failed = getattr(exc, "index", None)
                if failed is None:
                    raise
                # The store's own error, as a single call would have raised it, under the call's index.
                raise _at_index(
                    exc.__cause__ if isinstance(exc.__cause__, StoreError) else exc, stored[failed][0]
                ) from exc
            for (index, delay), result in zip(stored, inserted, strict=True):
                results[index] = self._stored_result(app, delay, result)
        for index, args, kwargs, options in sent:
            results[index] = self.apply_async(args, kwargs, **options)
        return results

    def _stored_delay(self, app: Any, config: Any, call: _Call, plan: DelayPlan) -> _StoredDelay:
        """The row of one long-delayed call: the argument checks and option merging plain apply_async does."""
        args, kwargs = call.args, call.kwargs
        if self.typing:
            header = getattr(self, "__header__", None)
            if header is not None:
                header(*(args or ()), **(kwargs or {}))
        shadow = call.shadow or self.shadow_name(args, kwargs, call.options)
        options = dict(self._get_exec_options(), **call.options)
        options.setdefault("ignore_result", self.ignore_result)
        add_to_parent = options.get("add_to_parent", True)
        parent = app.current_worker_task
        if parent is not None:
            options.setdefault("root_id", parent.request.root_id or parent.request.id)
            options.setdefault("parent_id", parent.request.id)
        if shadow:
            options["shadow"] = shadow
        if call.link:
            options["link"] = [dict(s) for s in _as_list(call.link)]
        if call.link_error:
            options["link_error"] = [dict(s) for s in _as_list(call.link_error)]
        # Nothing is published now, so no publish hook carries the caller's trace: the row must.
        options["headers"] = inject_context(options.get("headers"))
        serializer = options.get("serializer") or self.serializer or app.conf.task_serializer
        encoded = encode_call(args, kwargs, options, serializer, allow_pickle=config.allow_pickle)
        if config.broker_kind == C.BROKER_SQS:
            check_message_size(app, self.name, len(encoded.payload))

        expires = options.get("expires")
        expires_at = None if expires is None else expires_argument(expires)
        expires_in = expires_at if isinstance(expires_at, float) else None
        new = NewDelay(
            id=call.task_id or uuid(),
            task=self.name,
            payload=encoded.payload,
            content_type=encoded.content_type,
            content_encoding=encoded.content_encoding,
            due_at=plan.eta,
            countdown=plan.countdown,
            # Relative expires counts from the call, on the store's clock like the countdown.
            expires_at=expires_at if isinstance(expires_at, datetime) else None,
            expires_in=expires_in,
            idempotency_key=call.idempotency_key,
        )
        return _StoredDelay(new, add_to_parent and parent is not None, parent)

    def _stored_result(self, app: Any, delay: _StoredDelay, result: InsertResult) -> StoredAsyncResult:
        task_id = delay.new.id
        warn_once_if_not_installed(app)
        if result.created:
            logger.debug("stored %s[%s] due at %s", self.name, task_id, result.due_at)
            signals.delay_stored.send(sender=self, task_id=task_id, task_name=self.name, due_at=result.due_at)
        elif not (delay.new.idempotency_key or "").startswith(C.DEBOUNCE_KEY_PREFIX):
            logger.debug("idempotency key %r already pending as %s", delay.new.idempotency_key, result.task_id)
        async_result = self.AsyncResult(result.task_id)
        if delay.add_to_parent and result.created:
            delay.parent.add_trail(async_result)
        return async_result

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        # Task.__call__ pushes a request for the body: it must keep the worker's (id, retries,
        # headers), which Celery 5.4 drops (see compat.push_request).
        push_request(self, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if not request.called_directly:
            token = delivery_token(request)
            call = super().__call__
            if token is not None:
                return run_delivery(self, token, lambda: unique_tasks.run_unique(self, lambda: call(*args, **kwargs)))
            if (request.headers or {}).get(C.HEADER_STORED):
                # Published by a sweep from before the delivery record: nothing to check it against.
                logger.warning("running stored task %s[%s] published without a delivery token", self.name, request.id)
            if unique_tasks.spec_of(self) is not None:
                return unique_tasks.run_unique(self, lambda: call(*args, **kwargs))
        return super().__call__(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One ``apply_async`` call as its paths hand it on: built once where the call arrives.

    ``options`` holds the call's remaining options (the dict is the call's own, so a path may add a
    header to it); ``idempotency_key`` is what a stored row would hold (``caller:<task>:<key>``,
    ``unique:<key>`` or a debounce key), set once the path has decided it.
    """

    args: Any
    kwargs: Any
    options: dict[str, Any]
    task_id: str | None = None
    producer: Any = None
    link: Any = None
    link_error: Any = None
    shadow: str | None = None
    idempotency_key: str | None = None


@dataclasses.dataclass(frozen=True)
class _StoredDelay:
    """One call about to be stored, and the worker task (if any) whose trail its result joins."""

    new: NewDelay
    add_to_parent: bool
    parent: Any


def _debounced(options: Mapping[str, Any]) -> bool:
    return options.get(C.OPTION_DEBOUNCE) is not None or options.get(C.OPTION_DEBOUNCE_KEY) is not None


def _unpack_call(call: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``(args[, kwargs[, options]])`` of one ``apply_many`` call, checked."""
    if not isinstance(call, (tuple, list)) or not 1 <= len(call) <= 3:
        raise TypeError(f"expected (args, kwargs, options), got {call!r}")
    args, kwargs, options = (*call, None, None)[:3]
    if args is not None and not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    return args, kwargs, dict(options or {})


def _at_index(exc: Exception, index: int) -> Exception:
    """The error a single call raised, as the error of ``apply_many``'s item ``index`` (``exc.index``)."""
    try:
        named = type(exc)(f"apply_many item {index}: {exc}")
    except Exception:  # an exception class with another constructor
        named = BulkItemError(index, exc)
    named.index = index  # type: ignore[attr-defined]
    return named


def _delay_seconds(plan: DelayPlan | None, options: Mapping[str, Any], now: datetime) -> float:
    """Seconds from now until the call is due (0 for an immediate call): the key waits that long too."""
    countdown = plan.countdown if plan is not None else options.get("countdown")
    if countdown is not None:
        return max(0.0, float(countdown))
    eta = plan.eta if plan is not None else options.get("eta")
    if eta is not None:
        return max(0.0, (as_utc(eta) - now).total_seconds())
    return 0.0


def _unique_run_attr(cls: type) -> Any:
    """The ``run`` a task class defines (raw: a staticmethod or a function), or None (``Task.run``)."""
    for klass in cls.__mro__:
        if "run" in klass.__dict__:
            run = klass.__dict__["run"]
            return None if klass is Task else run
    return None


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
