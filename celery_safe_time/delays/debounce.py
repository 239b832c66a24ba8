"""Debounced calls: their options checked at the call site, their key rendered from the call's arguments.

``task.apply_async(args, kwargs, debounce=30, debounce_key="index:{site_id}", debounce_max_wait=300)``
stores the call as a row due ``debounce`` seconds from now; a later call with the same key, while that
row is pending, moves it to ``debounce`` seconds from its own time (never past the first call plus
``debounce_max_wait``) and replaces its arguments. The store does that in one transaction
(:meth:`~celery_safe_time.delays.backends.base.DelayStore.debounce`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from .. import constants as C
from ..exceptions import DebounceError
from ..locks.keys import KeyBuilder, KeySpec, escape_value

__all__ = [
    "RESERVED_KEY_PREFIXES",
    "DebounceCall",
    "caller_idempotency_key",
    "debounce_call",
    "seconds",
    "task_key",
    "unique_row_key",
]

#: (task class, key spec) -> its key builder: a template is checked against the signature once.
_BUILDERS: dict[tuple[type, Any], tuple[KeyBuilder, bool]] = {}
_BUILDERS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DebounceCall:
    """One debounced call's options, checked: the row's key, its quiet period and its cap (seconds)."""

    key: str
    period: float
    max_wait: float | None

    @property
    def stored_key(self) -> str:
        """What the row holds in its idempotency key (the pending-only unique key)."""
        return C.DEBOUNCE_KEY_PREFIX + self.key


#: The prefixes of what the package writes in a row's idempotency key (constants.DEBOUNCE_KEY_PREFIX and
#: its neighbours): a caller's key may not begin with one, so a key read back names its kind.
RESERVED_KEY_PREFIXES: tuple[str, ...] = (C.DEBOUNCE_KEY_PREFIX, C.CALLER_KEY_PREFIX, C.UNIQUE_ROW_KEY_PREFIX)


def task_key(prefix: str, task_name: str, key: str) -> str:
    """``<prefix><task name>:<key>``, the task name escaped like a key value: no other task's key equals it."""
    return f"{prefix}{escape_value(task_name)}:{key}"


def unique_row_key(key: str) -> str:
    """What a stored unique task's row holds: ``unique:<key>``, global like the key on the lock backend."""
    return C.UNIQUE_ROW_KEY_PREFIX + key


def caller_idempotency_key(task_name: str, value: Any) -> str | None:
    """A caller's ``idempotency_key=`` checked, as its row stores it: None, or ``caller:<task>:<key>``.

    Raises ``ValueError`` naming the option for a key that is not a non-empty string, begins with a
    reserved prefix or is too long with the task's name. Stored under the task's name, a key passed
    through from a client (an ``Idempotency-Key`` header) matches that task's own pending rows only:
    never another task's call, debounced burst or unique row.
    """
    if value is None:
        return None
    where = f"task {task_name}: {C.OPTION_IDEMPOTENCY_KEY}"
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    for prefix in RESERVED_KEY_PREFIXES:
        if value.startswith(prefix):
            raise ValueError(f"{where}={value[:60]!r} begins with {prefix!r}, a prefix reserved for the package's keys")
    stored = task_key(C.CALLER_KEY_PREFIX, task_name, value)
    if len(stored) > C.DELAY_KEY_LENGTH:
        room = C.DELAY_KEY_LENGTH - (len(stored) - len(value))
        raise ValueError(f"{where} is longer than {room} characters with the task's name ({value[:60]!r}...)")
    return stored


def seconds(value: Any, option: str) -> float:
    """A ``timedelta`` or a number of seconds as a positive float; :class:`DebounceError` otherwise."""
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        raise DebounceError(f"{option} must be a timedelta or a number of seconds, got {value!r}")
    if not result > 0:
        raise DebounceError(f"{option} must be positive, got {value!r}")
    return result


def debounce_call(
    task_name: str,
    run: Any,
    task_class: type,
    options: Mapping[str, Any],
    args: Any,
    kwargs: Any,
    *,
    sweep_interval: float,
) -> DebounceCall:
    """Check one call's debounce options and render its key; raises :class:`DebounceError` naming the task.

    ``run`` is the task's raw ``run`` attribute (a function, or a staticmethod when it takes no task
    argument); ``options`` are the call's ``apply_async`` options, debounce ones included.
    """
    where = f"task {task_name}"
    period = seconds(options.get(C.OPTION_DEBOUNCE), f"{where}: debounce")
    if period < sweep_interval:
        raise DebounceError(
            f"{where}: debounce={period:g}s is shorter than the sweep interval ({sweep_interval:g}s, "
            "safe_time_sweep_interval): the sweep publishes the row up to one interval late, so a shorter "
            "period cannot be kept"
        )
    raw_wait = options.get(C.OPTION_DEBOUNCE_MAX_WAIT)
    max_wait = None if raw_wait is None else seconds(raw_wait, f"{where}: debounce_max_wait")
    if max_wait is not None and max_wait < period:
        raise DebounceError(f"{where}: debounce_max_wait={max_wait:g}s is shorter than debounce={period:g}s")
    spec = options.get(C.OPTION_DEBOUNCE_KEY)
    if spec is None or spec == "":
        raise DebounceError(
            f"{where}: debounce needs debounce_key= (a template over the task's arguments such as "
            "'index:{site_id}', or a callable): calls with the same key form one burst"
        )
    for other in (C.OPTION_IDEMPOTENCY_KEY, "countdown", "eta"):
        if options.get(other) is not None:
            raise DebounceError(f"{where}: debounce decides the due time and the key; {other}= cannot be given too")
    key = task_key("", task_name, _render(task_class, run, spec, args, kwargs, where))
    if len(C.DEBOUNCE_KEY_PREFIX + key) > C.DELAY_KEY_LENGTH:
        raise DebounceError(
            f"{where}: debounce key {key[:60]!r}... is longer than {C.DELAY_KEY_LENGTH - len(C.DEBOUNCE_KEY_PREFIX)}"
            " characters with the task name"
        )
    return DebounceCall(key=key, period=period, max_wait=max_wait)


def _render(task_class: type, run: Any, spec: KeySpec, args: Any, kwargs: Any, where: str) -> str:
    builder, bound = _builder(task_class, run, spec, where)
    try:
        return builder.render(tuple(args or ()), dict(kwargs or {}), bound=bound)
    except (TypeError, AttributeError, LookupError, ValueError) as exc:  # arguments the template cannot format
        raise DebounceError(f"{where}: debounce_key={spec!r}: {exc}") from None


def _builder(task_class: type, run: Any, spec: KeySpec, where: str) -> tuple[KeyBuilder, bool]:
    cache_key = (task_class, spec)
    try:
        found = _BUILDERS.get(cache_key)
    except TypeError:  # an unhashable callable: built per call
        found, cache_key = None, None  # type: ignore[assignment]
    if found is not None:
        return found
    if run is None:
        raise DebounceError(f"{where}: debounce_key needs a task with a run function to bind its arguments")
    bound = not isinstance(run, staticmethod)
    func: Callable[..., Any] = run.__func__ if isinstance(run, staticmethod) else run
    try:
        built = (KeyBuilder(func, spec), bound)
    except (ValueError, TypeError) as exc:
        raise DebounceError(f"{where}: debounce_key={spec!r}: {exc}") from None
    if cache_key is not None:
        with _BUILDERS_LOCK:
            _BUILDERS[cache_key] = built
    return built
