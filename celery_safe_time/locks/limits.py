"""Flow control per key across every worker: ``@rate_limit`` and ``@concurrency_limit`` (docs/flow-control.md).

A rate limit is a sliding log on the lock backend (:mod:`.rates`). A call over it reserves the first
place that frees and is re-queued to that instant with its reservation's token: through the broker
within ``safe_time_delay_threshold``, else through the store, so the broker never holds it long
enough to hand it out again.

A concurrency limit is ``limit`` overlap locks per key, the slots ``<key>#0`` ... ``<key>#<limit-1>``:
a call takes the first free one and holds it as ``@overlap_lock`` holds its lock.
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from .. import constants as C
from .. import signals
from ..exceptions import RateLimited
from ..messages.requeue import message_header
from .backends import Holder, LockBackend, get_lock_backend
from .keys import KeyBuilder, KeySpec
from .overlap import overlap_lock
from .rates import Rate, parse_rate
from .runtime import (
    Call,
    HeldLock,
    Policy,
    TaskLock,
    _unavailable,
    check_decorates_function,
    gate_calls,
    header_float,
    new_token,
    note_orphan,
    requeue,
    resolve_call,
    wrap,
)

logger = logging.getLogger(__name__)

#: At most this many waits in the worker (``C.RATE_LEAD`` each) per delivery before it is re-queued again.
RATE_LEAD_TRIES = 3

__all__ = ["concurrency_limit", "rate_limit"]

F = TypeVar("F", bound=Callable[..., Any])

RateSpec = str | Rate | Callable[..., str | Rate]
LimitSpec = int | Callable[..., int]


# --- rate limits ---------------------------------------------------------------------------------


class RateLimiter:
    """The rate limit one decorated function applies before its body (see :func:`rate_limit`)."""

    def __init__(self, builder: KeyBuilder, rate: RateSpec, policy: Policy, jitter: float | None) -> None:
        self.builder = builder
        self.rate = rate if callable(rate) else parse_rate(rate)
        self.policy = policy
        self.jitter = jitter

    def rate_for(self, call: Call) -> Rate:
        if not callable(self.rate):
            return self.rate
        try:
            return parse_rate(self.builder.call_with(self.rate, call.args, call.kwargs, bound=call.bound))
        except ValueError as exc:
            raise ValueError(f"the rate callable of {self.builder.spec!r}: {exc}") from None

    def countdown(self, wait: float) -> float:
        """Seconds to re-queue a call whose reservation is due in ``wait`` seconds: ``RATE_LEAD`` ahead
        of it, plus up to ``jitter`` (none by default: a reservation is a place of its own)."""
        return max(wait - C.RATE_LEAD, 0.0) + (self.jitter or 0.0) * random.random()

    def __call__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = resolve_call(args, kwargs)
        key = self.builder.render(call.args, call.kwargs, bound=call.bound)
        rate = self.rate_for(call)
        store = get_lock_backend(call.app)
        token = (message_header(call.request, C.HEADER_RATE_TOKEN) if call.in_worker else None) or new_token()
        try:
            taken = store.rate_take(key, token, rate, reserve=call.in_worker)
            for _ in range(RATE_LEAD_TRIES):
                if taken.admitted or not call.in_worker or taken.wait > 2 * C.RATE_LEAD:
                    break
                # Back a little ahead of its reservation (see RATE_LEAD), or a call ahead started a
                # moment late: wait here, then take it.
                store.rate_wait(taken.wait)
                taken = store.rate_take(key, token, rate)
        except (redis.RedisError, OSError) as exc:
            self.policy.backend_down(call, _unavailable(key, store, exc), store.label)
            return None
        task_name = getattr(call.task, "name", None)
        since = header_float(call.request, C.HEADER_RATE_SINCE) if call.in_worker else None
        if taken.admitted:
            lateness = max(0.0, time.time() - since) if since is not None else 0.0
            signals.rate_limit_admitted.send(
                sender=call.task,
                key=key,
                task_id=call.task_id,
                task_name=task_name,
                lateness=lateness,
                started_at=taken.at,
            )
            return func(*args, **kwargs)
        countdown = self.countdown(taken.wait)
        signals.rate_limited.send(
            sender=call.task, key=key, task_id=call.task_id, task_name=task_name, wait=taken.wait, countdown=countdown
        )
        logger.info("rate limit %r (%s) is full; re-queueing %s in %.3fs", key, rate, call.task_id, countdown)
        requeue(
            call,
            countdown,
            RateLimited(key, taken.wait, str(rate)),
            extra_headers={
                C.HEADER_RATE_SINCE: since if since is not None else time.time(),
                C.HEADER_RATE_TOKEN: token,
                C.HEADER_RATE_KEY: key,
            },
        )


def rate_limit(
    key: KeySpec,
    rate: RateSpec,
    *,
    jitter: float | None = None,
    on_backend_error: C.OnBackendError = "retry",
) -> Callable[[F], F]:
    """Start at most ``rate`` calls per key across every worker; place it below ``@app.task``.

    ``key``: a template over the task's parameters (``"stripe:{account_id}"``) or a callable taking
    the task's arguments, as for ``overlap_lock``. ``rate``: ``"<count>/<period>"`` (``"100/m"``,
    ``"20/s"``, ``"5/10s"``, ``"1/500ms"``, ``"1000/h"``) or a callable taking the task's arguments
    and returning one (a limit per plan or customer). At most ``count`` calls of a key start within
    any ``period`` (a sliding window; a burst of ``count`` at once is allowed). A call over the limit
    reserves the first place that frees and is re-queued to that instant, plus up to ``jitter``
    seconds (default 0); it does not use up ``max_retries``. Outside a worker (a direct or eager
    call) it raises :class:`~celery_safe_time.exceptions.RateLimited` and reserves nothing.
    ``on_backend_error``: as for ``overlap_lock`` (the body never runs unchecked).
    """
    check_decorates_function(key, "rate_limit", '"my-key:{arg}", "10/s"')
    # The order fix shows the call as written, the rate included.
    example = f"{key!r}, {rate!r}" if isinstance(key, str) and isinstance(rate, str) else "key, rate"
    if not callable(rate):
        rate = parse_rate(rate)
    policy = Policy(ttl=None, on_conflict="retry", retry_after=1.0, jitter=jitter, on_backend_error=on_backend_error)
    spec = rate

    def decorate(func: F) -> F:
        check_decorates_function(func, "rate_limit", example)
        limiter = RateLimiter(KeyBuilder(func, key), spec, policy, jitter)
        return gate_calls(func, limiter, __safe_time_rate_limit__=limiter)

    return decorate


# --- concurrency limits --------------------------------------------------------------------------


class SlotLock(TaskLock):
    """``limit`` overlap locks per key, one per slot; a call holds the first free one."""

    def __init__(self, builder: KeyBuilder, policy: Policy, limit: LimitSpec) -> None:
        super().__init__(builder, policy)
        self.limit = limit

    def limit_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, bound: bool) -> int:
        if not callable(self.limit):
            return self.limit
        limit = self.builder.call_with(self.limit, args, kwargs, bound=bound)
        return check_limit(limit, f"the limit callable of {self.builder.spec!r} returned")

    def held_keys_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, bound: bool) -> tuple[str, ...]:
        key = self.lock_key_for(args, kwargs, bound=bound)
        return tuple(slot_key(key, slot) for slot in range(self.limit_for(args, kwargs, bound=bound)))

    def take(self, call: Call, key: str, marker: str | None = None) -> tuple[HeldLock, float | None] | None:
        """The first free slot of ``key`` for ``call`` (and the hard deadline), or None when the body
        must not run (the policy has handled a full key, a duplicate or the backend being down).

        A delivery tries the slots from one that its identity picks (its home slot), so callers
        spread over the slots instead of all asking slot 0 first. A delivery that ends on another
        slot records itself finished on its home slot too, where a copy of it looks first. A copy
        (a broker redelivery, or our re-queue of this delivery) first looks for the slot its
        delivery holds, whichever it is: one whose original still runs is a duplicate there, never
        admitted to a free slot beside it.
        """
        ttl, first_ttl, deadline, store = self.lease(call)
        owner = call.owner()
        limit = self.limit_for(call.args, call.kwargs, bound=call.bound)
        home = zlib.crc32(owner.identity.encode()) % limit
        order = [(home + step) % limit for step in range(limit)]
        holder: Holder | None = None
        try:
            if may_be_copy(call):
                mine = [n for n in order if _held_by(store, slot_key(key, n), owner.task_id)]
                order = mine + [n for n in order if n not in mine]
        except (redis.RedisError, OSError) as exc:
            self.policy.backend_down(call, _unavailable(key, store, exc), store.label)
            return None
        for number in order:
            slot = slot_key(key, number)
            token = new_token()
            try:
                acquired = store.acquire(slot, token, first_ttl, owner, earlier_tokens=call.earlier_tokens(slot))
            except (redis.RedisError, OSError) as exc:
                note_orphan(call, slot, token)
                self.policy.backend_down(call, _unavailable(slot, store, exc), store.label)
                return None
            if acquired.status == "finished":
                self.policy.finished(call, slot)
            if acquired.status == "duplicate":
                self.policy.duplicate(call, slot, acquired.holder)
            if acquired.status == "acquired" and acquired.fence is not None:
                identity = owner.identity if call.in_worker else None
                held = SlotHeld(store, slot, token, acquired.fence, ttl, owner.task_id, identity, acquired.sent_at)
                held.home = slot_key(key, home) if number != home else None
                return held, deadline
            holder = holder or acquired.holder
        self.policy.conflict(call, key, holder)
        return None


class SlotHeld(HeldLock):
    """A held slot that also records its delivery finished on the delivery's home slot (the one a
    copy of it tries first) when it holds another."""

    home: str | None = None

    def release(self, finished: bool = True) -> bool:
        self._finish_at_home(finished)
        return super().release(finished)

    def release_after_run(self, finished: bool = True) -> None:
        self._finish_at_home(finished)
        super().release_after_run(finished)

    def _finish_at_home(self, finished: bool) -> None:
        record = self.finished_record() if finished else None
        if record is None or self.home is None:
            return
        # An empty token never holds a lock: only the finished marker is written.
        self.store.release_later(self.home, "", record, _home_recorded)


def _home_recorded(released: bool | None, error: BaseException | None) -> None:
    if error is not None:
        if not isinstance(error, (redis.RedisError, OSError)):
            raise error
        logger.warning("could not record a finished delivery on its home slot (a late copy may run again): %s", error)


def may_be_copy(call: Call) -> bool:
    """Whether this delivery may already hold a gate: a broker redelivery (the broker handed the
    message out again) or our re-queue of an earlier attempt of this delivery."""
    if not call.in_worker or call.request is None:
        return False
    if call.origin is not None:
        return True
    info = getattr(call.request, "delivery_info", None)
    return bool(isinstance(info, dict) and info.get("redelivered"))


def _held_by(store: LockBackend, slot: str, task_id: str | None) -> bool:
    record = store.holder_record(slot)
    return record is not None and task_id is not None and record[1] == task_id


def slot_key(key: str, slot: int) -> str:
    """The overlap lock key of ``key``'s slot number ``slot``."""
    return C.SLOT_KEY.format(key=key, slot=slot)


def check_limit(limit: Any, what: str = "limit") -> int:
    """``limit`` when it is an int of at least 1, else a ``ValueError``/``TypeError`` saying so."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"{what} {limit!r}: a concurrency limit must be an int (at least 1)")
    if limit < 1:
        raise ValueError(f"{what} {limit!r}: a concurrency limit must be at least 1")
    return limit


def concurrency_limit(
    key: KeySpec,
    limit: LimitSpec,
    *,
    ttl: float | None = None,
    on_conflict: C.OnConflict = "retry",
    retry_after: float = C.DEFAULT_LOCK_RETRY_AFTER,
    jitter: float | None = None,
    on_backend_error: C.OnBackendError = "retry",
) -> Callable[[F], F]:
    """Run at most ``limit`` calls per key at once across every worker; place it below ``@app.task``.

    ``limit``: an int of at least 1, or a callable taking the task's arguments and returning one (10
    for premium tenants, 3 for the others). ``limit=1`` is ``overlap_lock`` (the same lock key). The
    other options are ``overlap_lock``'s: ``ttl`` is each slot's lease, renewed every ``ttl/3`` while
    the body runs, so a killed worker's slot frees within ``ttl``; ``on_conflict`` says what a call
    finding every slot taken does (``"retry"`` re-queues it after ``retry_after`` plus jitter,
    ``"skip"``, ``"raise"``). While the body runs, ``current_fence()`` is its slot's fencing number and
    ``current_lock().key`` names the slot (``<key>#<n>``).
    """
    check_decorates_function(key, "concurrency_limit", '"my-key:{arg}", limit=3')
    if not callable(limit):
        check_limit(limit)
        if limit == 1:
            return overlap_lock(
                key,
                ttl=ttl,
                on_conflict=on_conflict,
                retry_after=retry_after,
                jitter=jitter,
                on_backend_error=on_backend_error,
            )
    policy = Policy(
        ttl=ttl, on_conflict=on_conflict, retry_after=retry_after, jitter=jitter, on_backend_error=on_backend_error
    )

    def decorate(func: F) -> F:
        check_decorates_function(
            func,
            "concurrency_limit",
            f"{key!r}, limit={limit!r}" if isinstance(key, str) and isinstance(limit, int) else "key, limit=...",
        )
        return wrap(func, SlotLock(KeyBuilder(func, key), policy, limit))

    return decorate
