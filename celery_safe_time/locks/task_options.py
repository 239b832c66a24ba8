"""Flow control as task options of a ``SafeTask``, checked when the task is defined.

::

    @app.task(base=SafeTask, safe_time_rate_limit="100/m", safe_time_rate_key="stripe:{account_id}")
    def charge(account_id, amount): ...

    @app.task(base=SafeTask, safe_time_concurrency_limit=3, safe_time_concurrency_key="export:{tenant_id}")
    def export(tenant_id): ...

The options are the decorators (:func:`~.limits.rate_limit`, :func:`~.limits.concurrency_limit`) applied
to the task's ``run``: the same keys, the same backend state, the same behaviour over the limit. A limit
without a key is one key for the whole task, its name: ``safe_time_rate_limit="20/s"`` alone is Celery's
``rate_limit`` across every worker instead of per worker. With both options the rate limit is checked
first, then a slot is taken (a call waiting for its rate does not hold a slot).
"""

from __future__ import annotations

from typing import Any

from .. import constants as C
from .keys import KeySpec
from .limits import check_limit, concurrency_limit, rate_limit
from .rates import parse_rate

__all__ = ["apply_flow_options", "original_run"]

#: The attribute a wrapped ``run`` function keeps the task's own function in (so a subclass wraps
#: the original again instead of the wrapper).
_ORIGINAL = "__safe_time_flow_original__"


def original_run(run: Any) -> Any:
    """The raw ``run`` (a function or a staticmethod) as the task defined it, without flow options."""
    func = run.__func__ if isinstance(run, staticmethod) else run
    original = getattr(func, _ORIGINAL, None)
    if original is None:
        return run
    return staticmethod(original) if isinstance(run, staticmethod) else original


def apply_flow_options(cls: type, task_name: str, run: Any) -> None:
    """Check ``cls``'s flow-control options and wrap its ``run`` with them (or unwrap it when a
    subclass sets them to None). ``run`` is the class's raw ``run`` attribute (None: no body yet).

    Raises ``ValueError``/``TypeError`` naming the task and the option: a malformed rate, a limit
    below 1, a key without its limit, a key template naming a parameter the task does not have.
    """
    if run is None:
        return
    where = f"task {task_name}"
    rate = getattr(cls, C.OPTION_RATE_LIMIT, None)
    rate_key = getattr(cls, C.OPTION_RATE_KEY, None)
    limit = getattr(cls, C.OPTION_CONCURRENCY_LIMIT, None)
    limit_key = getattr(cls, C.OPTION_CONCURRENCY_KEY, None)
    for key, option, needs in (
        (rate_key, C.OPTION_RATE_KEY, C.OPTION_RATE_LIMIT),
        (limit_key, C.OPTION_CONCURRENCY_KEY, C.OPTION_CONCURRENCY_LIMIT),
    ):
        if key is not None and getattr(cls, needs, None) is None:
            raise ValueError(f"{where}: {option}={key!r} needs {needs}= (the limit the key counts against)")
    original = original_run(run)
    func = original.__func__ if isinstance(original, staticmethod) else original
    wrapped = func
    if limit is not None:
        if not callable(limit):
            check_limit(limit, f"{where}: {C.OPTION_CONCURRENCY_LIMIT}")
        key = _key(limit_key, task_name, where, C.OPTION_CONCURRENCY_KEY)
        wrapped = _decorate(lambda: concurrency_limit(key, limit), wrapped, where, C.OPTION_CONCURRENCY_KEY, key)
    if rate is not None:
        if not callable(rate):
            try:
                rate = parse_rate(rate)
            except ValueError as exc:
                raise ValueError(f"{where}: {C.OPTION_RATE_LIMIT}={rate!r}: {exc}") from None
        key = _key(rate_key, task_name, where, C.OPTION_RATE_KEY)
        spec = rate
        wrapped = _decorate(lambda: rate_limit(key, spec), wrapped, where, C.OPTION_RATE_KEY, key)
    if wrapped is func:
        if original is not run:
            cls.run = original  # type: ignore[attr-defined]
        return
    setattr(wrapped, _ORIGINAL, func)
    cls.run = staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped  # type: ignore[attr-defined]


def _key(key: Any, task_name: str, where: str, option: str) -> KeySpec:
    if key is None:
        # One key for the whole task: a constant template (its braces doubled: task names have none).
        return task_name.replace("{", "{{").replace("}", "}}")
    if not (isinstance(key, str) and key) and not callable(key):
        raise TypeError(f"{where}: {option} must be a key template such as 'stripe:{{account_id}}' or a callable")
    return key  # type: ignore[no-any-return]


def _decorate(make: Any, func: Any, where: str, option: str, key: KeySpec) -> Any:
    """``make()(func)``, its definition errors (a template naming a missing parameter) named by option."""
    try:
        return make()(func)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{where}: {option}={key!r}: {exc}") from None
