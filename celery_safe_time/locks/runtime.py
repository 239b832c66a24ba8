"""What ``overlap_lock`` and ``idempotent`` share: finding the running task, the options
(:class:`Policy`), taking the lock (:class:`TaskLock`), holding it around the body (watchdog,
fencing number, ``LockLost``) and re-queueing on a conflict.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import redis
from celery import Celery, Task, current_app
from celery._state import get_current_task
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_postrun

from .. import constants as C
from .. import handoff, signals
from ..config import SafeTimeConfig, get_config, seconds_argument
from ..exceptions import (
    CoordinationUnavailable,
    DecoratorOrderError,
    LockConflict,
    LockLost,
    SafeTimeError,
)
from ..messages.requeue import attempt_of, jittered, message_header, outage_backoff
from .backends import Holder, LockBackend, Owner, get_lock_backend
from .hard_limit import hard_deadline
from .keys import KeyBuilder
from .redis_wire import settle_posted
from .watchdog import Interrupter, Watchdog, renewal_ttl

logger = logging.getLogger(__name__)

#: At most this many lost-reply tokens travel in ``HEADER_LOCK_ORIGIN`` (the newest are kept).
LOCK_ORIGIN_MAX_TOKENS = 8
#: A finished delivery's marker (``KEY_LOCK_DONE``) lives at least this long: brokers without a
#: visibility timeout (RabbitMQ) redeliver at once on a lost connection, or after their consumer
#: timeout (30 min by default), and a requeued message may wait behind a backlog.
LOCK_DONE_TTL = 3600.0
#: ...and at least the broker's visibility_timeout plus this, after which Redis/SQS redeliver.
LOCK_DONE_TTL_MARGIN = 60.0

R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_HOST = socket.gethostname()


class Call:
    """One call of a decorated task function."""

    __slots__ = ("app", "args", "bound", "in_worker", "kwargs", "origin", "request", "task")

    def __init__(
        self, task: Task | None, bound: bool, args: tuple[Any, ...], kwargs: dict[str, Any], app: Celery
    ) -> None:
        self.task = task
        self.bound = bound
        self.args = args
        self.kwargs = kwargs
        self.app = app
        # Read once per call: ``task.request`` is a lookup in Celery's thread-local request stack, and a
        # locked call needs it about ten times.
        request = self.request = task.request if task is not None else None
        #: True when the call came from a message (so it can be re-queued).
        self.in_worker = bool(
            request is not None
            and request.id
            and not getattr(request, "called_directly", True)
            and not getattr(request, "is_eager", False)
        )
        #: The ``safe_time_lock_origin`` header of this delivery (read once: :meth:`owner` and
        #: :meth:`earlier_tokens` both need it), None when absent or not a worker call.
        self.origin = _origin(request) if self.in_worker else None

    @property
    def task_id(self) -> str | None:
        request = self.request
        return getattr(request, "id", None) if request is not None else None

    def owner(self) -> Owner:
        task_id = self.task_id or f"direct-{uuid.uuid4().hex}"
        # A direct or eager call is never redelivered: every call is a delivery of its own.
        identity = _identity(self.request, self.origin) if self.in_worker else f"{task_id}:direct-{uuid.uuid4().hex}"
        return Owner(task_id=task_id, identity=identity, host=_HOST, pid=os.getpid())

    def earlier_tokens(self, key: str) -> tuple[str, ...]:
        """Tokens earlier attempts of this delivery sent for ``key`` without learning the outcome."""
        return tuple(token for lock, token in _tokens(self.origin) if lock == key)

    def render(self, builder: KeyBuilder) -> str:
        return builder.render(self.args, self.kwargs, bound=self.bound)


def new_token() -> str:
    """A lock token: 128 random bits as 32 hex digits (``uuid4().hex`` without building a UUID)."""
    return os.urandom(16).hex()


def resolve_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Find the task a wrapper runs in: the ``self`` of a bind=True task, else the current task."""
    if args and isinstance(args[0], Task):
        task: Task = args[0]
        return Call(task=task, bound=True, args=args[1:], kwargs=kwargs, app=task.app)
    current = get_current_task()
    app = current.app if current is not None else current_app._get_current_object()
    return Call(task=current, bound=False, args=args, kwargs=kwargs, app=app)


def _requeues(request: Any) -> int:
    raw = message_header(request, C.HEADER_LOCK_REQUEUES)
    try:
        return int(raw or 0)
    except (TypeError, ValueError):
        return 0


def header_float(request: Any, name: str) -> float | None:
    """The message header ``name`` of ``request`` as a float; None when absent or not a number."""
    raw = message_header(request, name)
    try:
        return float(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None


def backend_down_cap(config: SafeTimeConfig) -> float:
    """The longest re-queue countdown through a lock backend outage: ``LOCK_REDIS_DOWN_BACKOFF_CAP``, and at most half
    of what makes the broker hand a held countdown out again or close the worker's channel."""
    cap = C.LOCK_REDIS_DOWN_BACKOFF_CAP
    for limit in (config.visibility_timeout, config.broker_consumer_timeout):
        if limit is not None:
            cap = min(cap, limit / 2.0)
    return cap


def _retries(request: Any) -> int:
    try:
        return int(getattr(request, "retries", 0) or 0)
    except (TypeError, ValueError):
        return 0


def _origin(request: Any) -> dict[str, Any] | None:
    """The ``safe_time_lock_origin`` header when it belongs to this delivery, else None.

    ``retry()`` copies custom headers into the retried message, which is a new delivery: a header
    stamped at another retry count is ignored.
    """
    origin = message_header(request, C.HEADER_LOCK_ORIGIN)
    if not isinstance(origin, dict) or not origin.get("identity"):
        return None
    try:
        same_retry = int(origin.get("retries", -1)) == _retries(request)
    except (TypeError, ValueError):
        return None
    return origin if same_retry else None


def delivery_identity(request: Any) -> str:
    """Which delivery of which message ``request`` is, the same for a broker redelivery of it.

    The ``safe_time_attempt`` header of the first message, carried by our own re-queues in
    ``safe_time_lock_origin``; for messages published without this package, the task id, retry
    count and re-queue count.
    """
    return _identity(request, _origin(request))


def _identity(request: Any, origin: dict[str, Any] | None) -> str:
    """:func:`delivery_identity`, given the request's :func:`_origin`."""
    if origin is not None:
        return str(origin["identity"])
    attempt = attempt_of(request)
    if attempt is not None:
        return attempt
    task_id = getattr(request, "id", None)
    return f"{task_id}:{_retries(request)}:{_requeues(request)}"


def _carried_tokens(request: Any) -> list[tuple[str, str]]:
    return _tokens(_origin(request))


def _tokens(origin: dict[str, Any] | None) -> list[tuple[str, str]]:
    pairs = origin.get("tokens") if origin is not None else None
    found: list[tuple[str, str]] = []
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, (list, tuple)) and len(pair) == 2:
            found.append((str(pair[0]), str(pair[1])))
    return found


_ORPHANS_ATTR = "_safe_time_lock_orphans"


def note_orphan(call: Call, key: str, token: str) -> None:
    """Remember a token whose acquire got no reply: it may have set the lock, so the re-queued
    copy carries it and takes such a lock over instead of treating it as a conflict."""
    request = call.request
    if request is not None and call.in_worker:
        orphans: list[tuple[str, str]] = getattr(request, _ORPHANS_ATTR, None) or []
        orphans.append((key, token))
        setattr(request, _ORPHANS_ATTR, orphans)


def origin_header(request: Any) -> dict[str, Any]:
    """The ``safe_time_lock_origin`` header a re-queue of ``request`` carries."""
    tokens = _carried_tokens(request) + list(getattr(request, _ORPHANS_ATTR, None) or [])
    return {
        "identity": delivery_identity(request),
        "retries": _retries(request),
        "tokens": [list(pair) for pair in tokens[-LOCK_ORIGIN_MAX_TOKENS:]],
    }


class AdmissionWatch:
    """What a caller outside the gates learns of a delivery, set on its request (the requests the task
    pushes inside copy the reference): ``on_admitted`` is called once, when every gate admitted the
    delivery, right before its body; ``outcome`` is how a gate ended it without the body, or None."""

    def __init__(self, on_admitted: Callable[[], object]) -> None:
        self.on_admitted = on_admitted
        self.admitted = False
        self.outcome: str | None = None


def note_admission(request: Any, outcome: str) -> None:
    """Say on ``request`` that a gate ended this delivery without running its body (``outcome``:
    ``ADMISSION_WAITING``, ``ADMISSION_DUPLICATE`` or ``ADMISSION_SKIPPED``): the gates taken before it
    release their holds as not run (:func:`run_holding`), and the run history reads it."""
    if request is not None:
        setattr(request, C.REQUEST_ADMISSION_ATTR, outcome)
        watch = getattr(request, C.REQUEST_ADMISSION_WATCH_ATTR, None)
        if isinstance(watch, AdmissionWatch):
            watch.outcome = outcome


def drop_unrun(call: Call, outcome: str) -> None:
    """A gate drops ``call`` without running its body: :func:`note_admission` ``outcome``, and free the
    place an inner ``rate_limit`` reserved for it on an earlier attempt (carried in its headers), or the
    calls behind it wait for a call that never comes."""
    if not call.in_worker:
        return
    note_admission(call.request, outcome)
    token = message_header(call.request, C.HEADER_RATE_TOKEN)
    key = message_header(call.request, C.HEADER_RATE_KEY)
    if not token or not key:
        return
    store = get_lock_backend(call.app)
    try:
        if store.rate_release(str(key), str(token)):
            logger.info("gave up the rate limit place of dropped call %s on %r", call.task_id, key)
    except (redis.RedisError, OSError) as exc:
        logger.warning(
            "could not give up the rate limit place of dropped call %s on %r (it ages out): %s", call.task_id, key, exc
        )


def admission_of(request: Any) -> str | None:
    """How a gate ended this delivery without running its body (:func:`note_admission`), or None."""
    own = getattr(request, "__dict__", None) if request is not None else None
    return own.get(C.REQUEST_ADMISSION_ATTR) if own is not None else None


def done_ttl(config: SafeTimeConfig) -> float:
    """How long a finished delivery is remembered: longer than the broker can take to redeliver it."""
    ttl = LOCK_DONE_TTL
    if config.visibility_timeout is not None:
        ttl = max(ttl, config.visibility_timeout + LOCK_DONE_TTL_MARGIN)
    if config.broker_consumer_timeout is not None:
        # RabbitMQ redelivers a message whose consumer timed out: keep the marker past that too.
        ttl = max(ttl, config.broker_consumer_timeout + LOCK_DONE_TTL_MARGIN)
    return ttl


def requeue(
    call: Call,
    countdown: float,
    exc: SafeTimeError,
    *,
    backend_down_since: float | None = None,
    extra_headers: dict[str, Any] | None = None,
) -> NoReturn:
    """Send the same message again in ``countdown`` seconds and end this run as RETRY: every gate's
    wait goes through here, to the broker or (beyond the delay threshold) to the store.

    Unlike ``Task.retry`` the retry count stays as it is (a header counts re-queues instead),
    so waiting for a lock never uses up the task's own ``max_retries``. Outside a worker
    (direct or eager calls) there is nothing to re-queue and ``exc`` is raised.
    """
    if not call.in_worker or call.task is None:
        raise exc
    task, request = call.task, call.request
    headers = dict(getattr(request, "headers", None) or {})
    headers[C.HEADER_LOCK_REQUEUES] = _requeues(request) + 1
    if backend_down_since is not None:
        headers[C.HEADER_LOCK_REDIS_DOWN] = backend_down_since
    else:
        headers.pop(C.HEADER_LOCK_REDIS_DOWN, None)  # the backend answered: the next outage starts over
    # The copy is a new publish (a new attempt token): say which delivery it continues.
    headers[C.HEADER_LOCK_ORIGIN] = origin_header(request)
    if extra_headers:
        headers.update(extra_headers)
    sig = task.signature_from_request(request, headers=headers)
    try:
        # The broker for a short wait, the store beyond the delay threshold (see send_later).
        handoff.send_later(task, sig, countdown)
    except Exception as publish_error:
        raise exc from publish_error
    # The delivery goes on in the copy: no gate taken before this one may record it as finished.
    note_admission(request, C.ADMISSION_WAITING)
    raise Retry(exc=exc, when=countdown, sig=sig)


@dataclasses.dataclass(eq=False, repr=False)
class HeldLock:
    """A lock this process holds around one task body.

    ``fence`` is the fencing number: pass it along with writes so the storage can reject a
    holder that has been superseded. :meth:`check` raises :class:`LockLost` once the watchdog
    failed to renew the lock.
    """

    #: Whether a delivered task's release (:meth:`release_after_run`) and ``idempotent``'s commit are
    #: sent without waiting for the answer where the backend can (Redis; the others answer at once):
    #: it is read after the task, before the delivery is acknowledged (:func:`_settle_after_task`), and
    #: a release or commit Redis did not run is run again then. The benchmark switches it off to
    #: measure the waiting path.
    answer_later = True

    store: LockBackend
    key: str
    token: str
    fence: int
    ttl: float
    task_id: str
    #: The delivery holding the lock; recorded as finished on release (None: nothing recorded).
    identity: str | None = None
    #: When the acquire was sent (``store.lease_clock``): the lease, and so the watchdog, runs from there.
    leased_at: float | None = None
    lost: str | None = dataclasses.field(default=None, init=False)
    _watchdog: Watchdog | None = dataclasses.field(default=None, init=False)
    _interrupter: Interrupter | None = dataclasses.field(default=None, init=False)

    def check(self) -> None:
        if self.lost is not None:
            raise LockLost(f"overlap lock {self.key!r} lost: {self.lost}")

    def start(self, sender: Any, hard_deadline: float | None) -> None:
        # The interrupter is made when the lock is lost, on the renewer thread, from the task
        # thread's id taken here: most locks are never lost, and making one costs a lock and a
        # module lookup.
        thread_id = threading.get_ident()

        def lost(reason: str) -> None:
            # Runs on the renewer thread inside Watchdog.tick, under the watchdog's mutex, which
            # stop() takes before it disarms: the interrupter is never made after stop() looked.
            self.lost = reason
            logger.error("overlap lock %r of task %s lost: %s", self.key, self.task_id, reason)
            signals.overlap_lock_lost.send(sender=sender, key=self.key, task_id=self.task_id)
            self._interrupter = Interrupter(thread_id)
            self._interrupter.fire(LockLost)

        self._watchdog = Watchdog(
            lambda ttl: self.store.renew(self.key, self.token, ttl),
            lost,
            ttl=self.ttl,
            interval=self.ttl / 3.0,
            hard_deadline=hard_deadline,
            margin=C.LOCK_HARD_LIMIT_MARGIN,
            clock=self.store.lease_clock,
        ).start(self.leased_at)

    def lease_ends_at(self) -> float:
        """When the lease the last successful renewal (or the acquire) asked for ends, on ``store.lease_clock``."""
        if self._watchdog is not None:
            return self._watchdog.last_ok + self.ttl
        return (self.store.lease_clock() if self.leased_at is None else self.leased_at) + self.ttl

    def stop(self) -> None:
        """Stop renewing and cancel a pending interrupt (the body has returned)."""
        if self._watchdog is not None:
            # First: it waits for a renewal in flight, so no lost() runs after this.
            self._watchdog.stop()
        if self._interrupter is not None:
            self._interrupter.disarm()

    def finished_record(self) -> tuple[str, float, str] | None:
        if self.identity is None:
            return None
        return self.identity, done_ttl(self.store.config), self.task_id

    def release(self, finished: bool = True) -> bool:
        """Compare-and-delete the lock; with ``finished``, record this delivery as ended. Returns whether
        it was still ours (False also when the store could not be reached: it expires by itself)."""
        try:
            released = self.store.release(self.key, self.token, self.finished_record() if finished else None)
        except (redis.RedisError, OSError) as exc:
            self.released(None, exc)
            return False
        self.released(released, None)
        return released

    def release_after_run(self, finished: bool = True) -> None:
        """:meth:`release` where a task body has ended: a delivered task sends it without waiting
        for the answer (see :attr:`answer_later`); a direct or eager call waits, as its caller may
        look at the lock next."""
        if self.answers_later:
            record = self.finished_record() if finished else None
            self.store.release_later(self.key, self.token, record, self.released)
        else:
            self.release(finished)

    @property
    def answers_later(self) -> bool:
        """Whether this lock's release (or commit) is sent without waiting: :attr:`answer_later`, for a
        delivered task only (a direct or eager caller may look at the lock next)."""
        return self.answer_later and self.identity is not None

    def released(self, released: bool | None, error: BaseException | None) -> None:
        """Log what a release answered (a ``Settle``: also called later, for a release sent earlier)."""
        if error is not None:
            if not isinstance(error, (redis.RedisError, OSError)):
                raise error
            logger.warning(
                "could not release overlap lock %r on %s (it expires in %.0fs): %s",
                self.key,
                self.store.label,
                self.ttl,
                error,
            )
        elif not released:
            logger.warning(
                "overlap lock %r had already expired or changed hands when task %s ended", self.key, self.task_id
            )


def _unavailable(key: str, store: LockBackend, exc: BaseException) -> CoordinationUnavailable:
    """The error a locked call that could not reach ``store`` ends with: ``RedisUnavailable`` on Redis,
    ``CoordinationUnavailable`` on the others, naming the key and the backend."""
    unavailable = store.unavailable(f"cannot take overlap lock {key!r} ({store.describe()}): {exc}")
    unavailable.__cause__ = exc
    return unavailable


def run_holding(
    held: HeldLock,
    call: Call,
    body: Callable[[], R],
    deadline: float | None,
    on_success: Callable[[R], None] | None = None,
) -> R:
    """Run ``body`` while ``held`` is renewed; release it on every exit path Python sees.

    A hard time limit kills the process, so no ``finally`` runs: see :mod:`.hard_limit`.
    """
    request = call.request
    if request is not None:
        setattr(request, C.REQUEST_FENCE_ATTR, held.fence)
        setattr(request, C.REQUEST_LOCK_ATTR, held)
    held.start(call.task, deadline)
    committed = False
    finished = True
    try:
        try:
            try:
                result = body()
            finally:
                held.stop()
        except LockLost as exc:
            raise LockLost(f"overlap lock {held.key!r} lost while task {held.task_id} ran: {held.lost}") from exc
        except Reject as exc:
            # Reject(requeue=True) hands this very message back to the broker to run again.
            finished = not exc.requeue
            raise
        if on_success is not None and admission_of(request) is None:
            # The body returned, so its effect happened: record it even if the lock was lost
            # meanwhile (check() below still fails the task), or a later call would run it again.
            # (An inner gate that skipped the body returns too: nothing happened, nothing is recorded.)
            on_success(result)
            committed = True
        held.check()
        return result
    finally:
        if not committed:
            # A gate inside this one re-queued the delivery: the body never ran and the delivery goes
            # on in the copy, so this hold ends as not run (the copy takes it again).
            if finished and admission_of(request) == C.ADMISSION_WAITING:
                finished = False
            held.release_after_run(finished=finished)


def _settle_after_task(**_: Any) -> None:
    """``task_postrun`` (the thread that ran the task, before an ``acks_late`` delivery is acknowledged):
    read the answers of the releases and commits it sent to Redis without waiting (:func:`settle_posted`)."""
    settle_posted()


task_postrun.connect(_settle_after_task, weak=False, dispatch_uid="celery_safe_time.locks.settle_after_task")


def send_conflict(call: Call, key: str, holder: str | None, action: str) -> None:
    signals.overlap_conflict.send(sender=call.task, key=key, task_id=call.task_id, holder=holder, action=action)


class Policy:
    """Validated options shared by ``overlap_lock`` and ``idempotent``."""

    def __init__(
        self,
        *,
        ttl: float | None,
        on_conflict: str,
        retry_after: float,
        jitter: float | None,
        on_backend_error: str,
    ) -> None:
        ttl = None if ttl is None else seconds_argument("ttl", ttl, positive=True, durations=True)
        if on_conflict not in C.ON_CONFLICT_POLICIES:
            raise ValueError(f"on_conflict must be one of {sorted(C.ON_CONFLICT_POLICIES)}, got {on_conflict!r}")
        if on_backend_error not in C.ON_BACKEND_ERROR_POLICIES:
            raise ValueError(
                f"on_backend_error must be one of {sorted(C.ON_BACKEND_ERROR_POLICIES)}, got {on_backend_error!r}"
            )
        if not retry_after >= 0:
            raise ValueError(f"retry_after must not be negative, got {retry_after!r}")
        if jitter is not None and not jitter >= 0:
            raise ValueError(f"jitter must not be negative, got {jitter!r}")
        self.ttl = ttl
        self.on_conflict = on_conflict
        self.retry_after = float(retry_after)
        self.jitter = float(retry_after * C.DEFAULT_LOCK_RETRY_JITTER if jitter is None else jitter)
        self.on_backend_error = on_backend_error

    def lock_ttl(self, call: Call) -> float:
        return self.ttl if self.ttl is not None else get_config(call.app).lock_ttl

    def conflict(self, call: Call, key: str, holder: Holder | None) -> None:
        """Apply ``on_conflict``: returns for ``skip``, raises for ``raise`` and ``retry``."""
        who = holder.describe() if holder is not None else None
        send_conflict(call, key, who, self.on_conflict)
        if self.on_conflict == "skip":
            logger.info("skipping %s: overlap lock %r is held by %s", call.task_id, key, who)
            drop_unrun(call, C.ADMISSION_SKIPPED)
            return
        exc = LockConflict(key, who)
        if self.on_conflict == "raise":
            raise exc
        countdown = jittered(self.retry_after, self.jitter)
        logger.info("overlap lock %r is held by %s; re-queueing %s in %.1fs", key, who, call.task_id, countdown)
        requeue(call, countdown, exc)

    def backend_down(self, call: Call, exc: CoordinationUnavailable, backend: str) -> None:
        """The lock ``backend`` (its label) is unreachable. Never run unguarded: re-queue (default) or raise."""
        if self.on_backend_error == "raise":
            raise exc
        # Wall time, carried in the message: the backend's clock is what is unreachable, and a few
        # seconds of skew between workers only shifts a back-off.
        now = time.time()
        # When the backend first failed for this delivery; None: it answered last time.
        since = header_float(call.request, C.HEADER_LOCK_REDIS_DOWN) or now
        base = max(self.retry_after, C.LOCK_REDIS_DOWN_BACKOFF_MIN)
        countdown = jittered(outage_backoff(base, now - since, backend_down_cap(get_config(call.app))), self.jitter)
        logger.warning(
            "%s; re-queueing %s in %.1fs (%s unreachable for %.1fs)", exc, call.task_id, countdown, backend, now - since
        )
        requeue(call, countdown, exc, backend_down_since=since)

    def duplicate(self, call: Call, key: str, holder: Holder | None) -> NoReturn:
        """The lock is held by this very delivery: a broker redelivery of a message that is still
        running, or whose worker died (kill -9) with the lock still unexpired. Which one cannot be
        told apart yet, so re-queue the copy (never ack and drop it, whatever ``on_conflict``
        says): it is dropped if the holder finishes, and runs once a dead holder's lock expires.
        """
        who = holder.describe() if holder is not None else None
        send_conflict(call, key, who, "duplicate")
        countdown = jittered(self.retry_after, self.jitter)
        logger.warning(
            "a redelivered copy of %s found its own delivery holding %r (still running, or its worker died);"
            " re-queueing it in %.1fs",
            call.task_id,
            key,
            countdown,
        )
        try:
            requeue(call, countdown, LockConflict(key, who))
        except LockConflict as exc:
            if not call.in_worker:
                raise
            # The re-queue could not be published (broker trouble): failing would ack the only
            # copy under acks_late; hand this message back to the broker instead.
            note_admission(call.request, C.ADMISSION_WAITING)
            raise Reject(exc, requeue=True) from exc

    @staticmethod
    def finished(call: Call, key: str) -> NoReturn:
        """This delivery already ran to its end (a late redelivery, or a re-queued copy of it)."""
        logger.warning("dropping a redelivered copy of %s: that delivery already ran under %r", call.task_id, key)
        send_conflict(call, key, None, "finished")
        drop_unrun(call, C.ADMISSION_DUPLICATE)
        raise Ignore()


class TaskLock:
    """The lock one decorated function takes around its body (``overlap_lock``; ``idempotent`` extends it)."""

    namespace = ""

    def __init__(self, builder: KeyBuilder, policy: Policy) -> None:
        self.builder = builder
        self.policy = policy

    def lock_key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, bound: bool) -> str:
        """The lock key (without prefix) of a call; ``args`` exclude the task instance."""
        return self.namespace + self.builder.render(args, kwargs, bound=bound)

    def held_keys_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, bound: bool) -> tuple[str, ...]:
        """The lock keys a call may hold (one here; a concurrency limit's slots): the hard-time-limit
        release looks at each."""
        return (self.lock_key_for(args, kwargs, bound=bound),)

    def __call__(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = resolve_call(args, kwargs)
        key = self.lock_key_for(call.args, call.kwargs, bound=call.bound)
        taken = self.take(call, key)
        if taken is None:
            return None
        held, deadline = taken
        logger.debug("task %s holds lock %r (fence %s)", held.task_id, held.key, held.fence)
        return run_holding(held, call, lambda: func(*args, **kwargs), deadline)

    def lease(self, call: Call) -> tuple[float, float, float | None, LockBackend]:
        """What an acquire for ``call`` needs: the lease, the first lease (cut short by the task's hard
        time limit), the hard deadline and the lock backend."""
        ttl = self.policy.lock_ttl(call)
        now = time.monotonic()
        deadline = hard_deadline(call, now)
        first_ttl = ttl if deadline is None else renewal_ttl(ttl, now, deadline, C.LOCK_HARD_LIMIT_MARGIN)
        return ttl, first_ttl, deadline, get_lock_backend(call.app)

    def take(self, call: Call, key: str, marker: str | None = None) -> tuple[HeldLock, float | None] | None:
        """Acquire ``key`` for ``call``: the held lock and the hard deadline, or None when the body
        must not run (the policy has handled a conflict, a duplicate or the backend being down)."""
        ttl, first_ttl, deadline, store = self.lease(call)
        owner = call.owner()
        token = new_token()
        earlier = call.earlier_tokens(key)
        try:
            acquired = store.acquire(key, token, first_ttl, owner, marker=marker, earlier_tokens=earlier)
        except (redis.RedisError, OSError) as exc:
            # A driver's error, or a backend's own CoordinationUnavailable (an OSError), becomes the
            # backend's error naming this key.
            unavailable = _unavailable(key, store, exc)
            # The script may have run and only its reply was lost: the lock may be ours now.
            note_orphan(call, key, token)
            self.policy.backend_down(call, unavailable, store.label)
            return None
        if acquired.status == "done" and marker is not None:
            self.already_done(call, marker)
            drop_unrun(call, C.ADMISSION_SKIPPED)
            return None
        if acquired.status == "finished":
            self.policy.finished(call, key)
        if acquired.status == "duplicate":
            self.policy.duplicate(call, key, acquired.holder)
        if acquired.status != "acquired" or acquired.fence is None:
            self.policy.conflict(call, key, acquired.holder)
            return None
        if acquired.took_over:
            logger.info(
                "task %s took over overlap lock %r (fence %s) that an earlier attempt set without hearing back",
                owner.task_id,
                key,
                acquired.fence,
            )
        identity = owner.identity if call.in_worker else None
        return HeldLock(store, key, token, acquired.fence, ttl, owner.task_id, identity, acquired.sent_at), deadline

    def already_done(self, call: Call, marker: str) -> None:
        """The key's marker says it already ran (only locks that pass a marker get here)."""


def check_decorates_function(func: Any, decorator: str, example: str) -> None:
    """Fail at decoration time when ``decorator`` was stacked above ``@app.task`` (it got a task, or the
    lazy proxy ``@app.task`` returns before the app is finalized, and would hand back a plain function
    without ``.delay``), with the order that works."""
    from celery.local import Proxy

    # type(func): a proxy reports its target's class through __class__, and asking would evaluate it.
    if issubclass(type(func), (Task, Proxy)):
        name = getattr(type(func), "__name__", "task")
        raise DecoratorOrderError(
            f"@{decorator} was given a Celery task ({name}), not a function: put it BELOW @app.task so it "
            f"wraps the task body, e.g.\n    @app.task\n    @{decorator}({example})\n    def my_task(...): ..."
        )


def wrap(func: F, lock: TaskLock) -> F:
    """Wrap ``func`` so every call runs through ``lock``; keeps its name and signature."""
    return gate_calls(func, lock, __safe_time_locks__=(*getattr(func, "__safe_time_locks__", ()), lock))


#: Set on a gate's wrapper (and copied outward by ``functools.wraps``): the function runs gates.
_GATED_MARK = "__safe_time_gated__"


def gate_calls(func: F, gate: Any, **marks: Any) -> F:
    """Wrap ``func`` so every call runs as ``gate(func, args, kwargs)`` (a lock, a rate limiter), with
    its name and signature; ``marks`` are set on the wrapper (what the task's options find). The
    innermost gate tells the delivery it is admitted (:func:`admitted`) right before the body."""
    inner = func if is_gated(func) else admitted_first(func)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # A stored wait's delivery is checked before its first gate (see handoff.checked_delivery).
        return handoff.checked_delivery(lambda: gate(inner, args, kwargs))

    # Celery checks call arguments against the task's signature; keep the real one.
    wrapper.__signature__ = gate.builder.signature  # type: ignore[attr-defined]
    setattr(wrapper, _GATED_MARK, True)
    for name, value in marks.items():
        setattr(wrapper, name, value)
    return cast(F, wrapper)


def is_gated(run: Any) -> bool:
    """Whether ``run`` (a task's ``run``, bound or not) passes its calls through gates first."""
    return bool(getattr(run, _GATED_MARK, False))


def admitted_first(func: Callable[..., R]) -> Callable[..., R]:
    """``func`` as the innermost gate calls it: the delivery is :func:`admitted` first."""

    def body(*args: Any, **kwargs: Any) -> R:
        admitted()
        return func(*args, **kwargs)

    return body


def admitted() -> None:
    """Every gate admitted the running delivery: tell its request's :class:`AdmissionWatch` (once)."""
    watch = getattr(getattr(get_current_task(), "request", None), C.REQUEST_ADMISSION_WATCH_ATTR, None)
    if isinstance(watch, AdmissionWatch) and not watch.admitted:
        watch.admitted = True
        watch.on_admitted()
