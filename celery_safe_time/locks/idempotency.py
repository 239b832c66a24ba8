"""``@idempotent``: the first successful run of a key wins; later and concurrent runs do not execute.

A run takes the overlap lock ``idem:<key>`` and, in the same script, checks the success marker
``<prefix>idem:<key>``. Success writes the marker (kept ``window`` seconds) and drops the lock in one
step; a failure records nothing. A body that returned always gets its marker, even when its lock was
lost meanwhile, and through a backend outage of up to about 30 s (``IDEMPOTENT_COMMIT_RETRY_DELAYS``);
past that the task still succeeds (failing it would invite a second run), logged as an error with
``signals.idempotent_unrecorded``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from .. import constants as C
from .. import signals
from ..config import seconds_argument
from .keys import KeyBuilder, KeySpec
from .runtime import (
    Call,
    HeldLock,
    Policy,
    TaskLock,
    check_decorates_function,
    done_ttl,
    resolve_call,
    run_holding,
    wrap,
)

logger = logging.getLogger(__name__)

#: A body that returned gets its idempotency marker recorded: the commit is retried after each
#: of these pauses (about 30 s in all) before the failure is reported (log + signal).
IDEMPOTENT_COMMIT_RETRY_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 5.0, 8.0, 10.0)
#: The shortest pause between commit attempts near the end of the in-progress lease.
IDEMPOTENT_COMMIT_MIN_PAUSE = 0.1

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["IdempotentLock", "idempotent"]


class IdempotentLock(TaskLock):
    namespace = C.IDEMPOTENT_LOCK_NAMESPACE

    def __init__(
        self,
        builder: KeyBuilder,
        policy: Policy,
        window: float,
        commit_delays: Sequence[float] = IDEMPOTENT_COMMIT_RETRY_DELAYS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(builder, policy)
        self.window = window
        #: Pauses between commit attempts after the body returned (one attempt more than pauses).
        self.commit_delays = tuple(commit_delays)
        self.sleep = sleep

    def __call__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = resolve_call(args, kwargs)
        marker = self.builder.render(call.args, call.kwargs, bound=call.bound)
        key = self.namespace + marker
        taken = self.take(call, key, marker=marker)
        if taken is None:
            return None
        held, deadline = taken

        def record(_result: Any) -> None:
            self._commit(held, marker, call)

        return run_holding(held, call, lambda: func(*args, **kwargs), deadline, on_success=record)

    def already_done(self, call: Call, marker: str) -> None:
        logger.info("skipping %s: idempotency key %r already ran", call.task_id, marker)
        signals.idempotent_skipped.send(sender=call.task, key=marker, task_id=call.task_id)

    def _commit(self, held: HeldLock, marker: str, call: Call) -> None:
        finished = (held.identity, done_ttl(held.store.config)) if held.identity is not None else None
        if not held.answers_later:
            self._commit_now(held, marker, call, finished)
            return

        def settled(answer: tuple[bool, bool] | None, error: BaseException | None) -> None:
            if error is None and answer is not None:
                self._recorded(answer[0], marker, call)
            elif isinstance(error, (redis.RedisError, OSError)):
                self._commit_now(held, marker, call, finished, failed=error)
            elif error is not None:
                raise error

        # Sent without waiting (HeldLock.answer_later): a failed first try is tried again, as below,
        # when its answer is read (after the task, before its delivery is acknowledged).
        held.store.commit_later(held.key, marker, held.token, self.window, held.task_id, finished, settled)

    def _commit_now(
        self,
        held: HeldLock,
        marker: str,
        call: Call,
        finished: tuple[str, float] | None,
        failed: BaseException | None = None,
    ) -> None:
        """Commit, trying again through an outage; ``failed``: the first try already failed so.

        The pauses follow ``commit_delays`` (their sum is the budget) but stay under a third of what
        is left of the lease: the body's renewals stopped when it returned, and once the lease ends
        another call may take the key and run it. A backend back before then is tried again in time.
        """
        # The body has had its effect. Failing the task now would invite a retry (a second run),
        # so keep trying to write the marker through an outage; the commit is safe to repeat (a
        # marker holding our token counts as ours). The in-progress lock blocks others meanwhile.
        error = failed
        budget = sum(self.commit_delays)
        scheduled = iter(self.commit_delays)
        paused = 0.0
        attempt = 0
        while True:
            attempt += 1
            if error is None:
                try:
                    recorded, _released = held.store.commit(
                        held.key, marker, held.token, self.window, held.task_id, finished
                    )
                except (redis.RedisError, OSError) as exc:
                    error = exc
                else:
                    self._recorded(recorded, marker, call)
                    return
            lease_left = held.lease_ends_at() - held.store.lease_clock()
            pause = commit_pause(
                next(scheduled, self.commit_delays[-1] if self.commit_delays else 0.0), budget - paused, lease_left
            )
            if pause is None:
                logger.error(
                    "task %s succeeded but idempotency key %r could NOT be recorded after %d attempts (%s: %s):"
                    " a later call of this key will run it again",
                    call.task_id,
                    marker,
                    attempt,
                    held.store.label,
                    error,
                )
                signals.idempotent_unrecorded.send(sender=call.task, key=marker, task_id=call.task_id, error=str(error))
                return
            logger.warning(
                "recording idempotency key %r of %s on %s failed (attempt %d), retrying in %.1fs: %s",
                marker,
                call.task_id,
                held.store.label,
                attempt,
                pause,
                error,
            )
            self.sleep(pause)
            paused += pause
            error = None

    @staticmethod
    def _recorded(recorded: bool, marker: str, call: Call) -> None:
        if not recorded:
            logger.warning("idempotency key %r was already recorded when %s finished", marker, call.task_id)


def commit_pause(scheduled: float, budget_left: float, lease_left: float) -> float | None:
    """The pause before the next commit attempt, or None to give up.

    ``scheduled``: the next of ``commit_delays`` (the last one again once they are used up and budget
    is left: pauses cut short by the lease leave some). ``lease_left``: seconds until the in-progress
    lease ends; while it runs the pause stays under a third of it (at least
    ``IDEMPOTENT_COMMIT_MIN_PAUSE``), so attempts come closer together as it nears its end instead of
    one long pause passing it.
    """
    if budget_left <= 1e-9:
        return None
    # (a scheduled pause that fits the budget is kept as written: no float drift from the subtraction)
    pause = scheduled if scheduled <= budget_left + 1e-9 else budget_left
    if lease_left > 0:
        pause = min(pause, max(IDEMPOTENT_COMMIT_MIN_PAUSE, lease_left / 3.0))
    return pause


def idempotent(
    key: KeySpec,
    *,
    window: float = C.DEFAULT_IDEMPOTENT_WINDOW,
    ttl: float | None = None,
    on_conflict: C.OnConflict = "retry",
    retry_after: float = C.DEFAULT_LOCK_RETRY_AFTER,
    jitter: float | None = None,
    on_backend_error: C.OnBackendError = "retry",
) -> Callable[[F], F]:
    """Run the task body at most once successfully per key within ``window`` seconds.

    ``key`` is a template over the task's parameters or a callable, as for
    :func:`~celery_safe_time.overlap_lock`. ``ttl`` is the in-progress lock's lease (default
    ``safe_time_lock_ttl``). ``on_conflict`` applies while another run of the same key is in
    progress (``"retry"``, ``"skip"``, ``"raise"``); ``on_backend_error`` as for ``overlap_lock``.
    """
    # ``@idempotent`` without arguments above ``@app.task`` passes the task as the key.
    check_decorates_function(key, "idempotent", '"my-key:{arg}"')
    window_seconds = seconds_argument("window", window, positive=True, durations=True)
    policy = Policy(
        ttl=ttl, on_conflict=on_conflict, retry_after=retry_after, jitter=jitter, on_backend_error=on_backend_error
    )

    def decorate(func: F) -> F:
        check_decorates_function(func, "idempotent", repr(key) if isinstance(key, str) else "key")
        return wrap(func, IdempotentLock(KeyBuilder(func, key), policy, window_seconds))

    return decorate
