"""The lock backend interface: what overlap locks, ``idempotent`` and unique tasks ask of a backend.

One module per backend: :mod:`.redis` (Lua scripts, the default), :mod:`.postgres` (rows on the
coordination database, ``safe_time_coordination_url``) and :mod:`.memory` (dicts in this process, the
testing plugin's). Every backend keeps the same rules, which the Redis scripts in ``locks/lua/``
define: an owner proves itself with a random token; a lock and a unique key expire on the backend's
own clock unless renewed; fencing numbers only ever grow; an idempotency marker lives for its window
and a finished-delivery marker for :func:`~celery_safe_time.locks.runtime.done_ttl`.

Names are the Redis key names (``<prefix>lock:<key>`` ...) on every backend, so ``locks list`` and
the logs read the same whichever one holds them.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from ... import constants as C
from ...config import SafeTimeConfig
from ...exceptions import CoordinationUnavailable
from ...redis_client import as_text
from ..rates import Rate, RateTaken
from ..redis_wire import Settle, settle_with

logger = logging.getLogger(__name__)

AcquireStatus = Literal["acquired", "held", "duplicate", "done", "finished"]


class Owner(NamedTuple):
    """Who asks for a lock: one delivery of one task message in one process.

    A named tuple, as :class:`Acquired` is: one of each is built per locked call, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) costs several times as much.
    """

    task_id: str
    identity: str
    host: str
    pid: int


@dataclasses.dataclass(frozen=True)
class Holder:
    """The current holder of a lock, as far as the lock's hash says."""

    task_id: str | None
    host: str | None
    pid: int | None
    fence: int | None

    def describe(self) -> str:
        return f"{self.task_id or '?'} on {self.host or '?'} (pid {self.pid or '?'})"


class Acquired(NamedTuple):
    """Result of :meth:`LockBackend.acquire`; ``fence`` is set when ``status == "acquired"``.

    ``took_over`` is True when the lock was already ours (a token of this delivery whose reply was
    lost): the caller now holds it with the fence that attempt was given. ``sent_at`` (set when
    acquired, on :attr:`LockBackend.lease_clock`) is when the request left: the lease runs from there.
    """

    status: AcquireStatus
    fence: int | None = None
    holder: Holder | None = None
    took_over: bool = False
    sent_at: float | None = None


@dataclasses.dataclass(frozen=True)
class LockInfo:
    """One held lock, for ``locks list`` and ``status``."""

    key: str
    redis_key: str
    task_id: str | None
    host: str | None
    pid: int | None
    fence: int | None
    age: float | None
    ttl_left: float | None
    #: ``"overlap"`` (an overlap or in-progress idempotent lock) or ``"unique"`` (a unique task's key).
    kind: str = "overlap"
    #: A unique key's state: queued, stored, running or retrying (None for overlap locks).
    state: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def unique(
        cls, key: str, redis_key: str, task_id: str | None, host: str | None, age: float | None, ttl_left: float | None,
        state: str | None,
    ) -> LockInfo:  # fmt: skip
        """A unique task's key as ``locks list`` shows it (``unique:<key>``)."""
        return cls(C.UNIQUE_LIST_PREFIX + key, redis_key, task_id, host, None, None, age, ttl_left, "unique", state)


UniqueStatus = Literal["acquired", "own", "held"]


class RateCount(NamedTuple):
    """One ``rate_limit`` key as an operator sees it: calls started within its last period
    (``started``) and calls re-queued to a place still ahead, waiting for the limit (``waiting``)."""

    key: str
    started: int
    waiting: int


@dataclasses.dataclass(frozen=True)
class UniqueClaim:
    """Result of :meth:`LockBackend.unique_acquire`; ``holder`` and the rest are set when ``"held"``."""

    status: UniqueStatus
    holder: str | None = None
    state: str | None = None
    #: The holder is a stored delay: its row in the store says whether it is gone.
    stored: bool = False
    ttl_left: float | None = None


def as_int(value: Any) -> int | None:
    text = as_text(value)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def as_ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


#: What a lock's holder looks like to the hard-time-limit release: (token, task id, host, pid).
HolderRecord = tuple[str | None, str | None, str | None, int | None]


class LockBackend(abc.ABC):
    """One app's locks on one backend; ``config`` gives the key prefix."""

    #: A short name for messages and ``status``: ``redis``, ``postgres``, ``memory``.
    kind: str = "?"
    #: The backend's name in log lines: ``Redis``, ``PostgreSQL``, ``memory``.
    label: str = "?"
    #: What a call that cannot reach this backend raises (the lock runtime wraps the driver's error).
    unavailable: type[CoordinationUnavailable] = CoordinationUnavailable

    config: SafeTimeConfig

    # --- key names (the same on every backend) ----------------------------------------------
    def lock_key(self, key: str) -> str:
        return self.config.key(C.KEY_LOCK, key=key)

    def fence_key(self, key: str) -> str:
        return self.config.key(C.KEY_LOCK_FENCE, key=key)

    def marker_key(self, key: str) -> str:
        return self.config.key(C.KEY_IDEMPOTENT, key=key)

    def done_key(self, key: str, identity: str) -> str:
        return self.config.key(C.KEY_LOCK_DONE, key=key, identity=identity)

    def unique_key(self, key: str) -> str:
        return self.config.key(C.KEY_UNIQUE, key=key)

    def rate_key(self, key: str) -> str:
        return self.config.key(C.KEY_RATE, key=key)

    def rate_starts_key(self, key: str) -> str:
        return self.config.key(C.KEY_RATE_STARTS, key=key)

    def user_key(self, redis_key: str, template: str = C.KEY_LOCK) -> str:
        """``<prefix>lock:<key>`` (``<prefix>lock:{<key>}`` on a cluster) -> ``<key>``; likewise for
        another single-key ``template`` (``unique:{key}``)."""
        head = self.config.key_prefix + template.format(key="")
        if not redis_key.startswith(head):
            return redis_key
        rest = redis_key[len(head) :]
        if not self.config.redis_cluster:
            return rest
        namespace = C.IDEMPOTENT_LOCK_NAMESPACE if rest.startswith(C.IDEMPOTENT_LOCK_NAMESPACE + "{") else ""
        tagged = rest[len(namespace) :]
        if tagged.startswith("{") and tagged.endswith("}"):
            inner = tagged[1:-1]
            return namespace + (inner[1:] if inner.startswith(C.CLUSTER_TAG_ESCAPE) else inner)
        return rest

    def describe(self) -> str:
        """Where the locks live, for error messages: the backend, its URL (masked) and its setting."""
        return self.kind

    def health(self) -> tuple[float, bool, int] | None:
        """(round trip seconds, whether the lock tables exist, held lock rows) of a backend with tables
        of its own, without creating anything; None for one whose server ``check_redis`` covers."""
        return None

    # --- ownership ------------------------------------------------------------------------------
    #: The clock a lease is dated by on this side (the watchdog's): when an acquire was sent, when
    #: its answer came. Tests replace it to make a reply late.
    lease_clock: Callable[[], float] = staticmethod(time.monotonic)

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        owner: Owner,
        *,
        marker: str | None = None,
        earlier_tokens: tuple[str, ...] = (),
    ) -> Acquired:
        """Take ``key`` unless it is held (or, with ``marker``, unless that idempotency key is recorded).

        ``status`` is ``"finished"`` when ``owner.identity`` already ran to its end, ``"duplicate"``
        when the lock is held by that same delivery (a redelivered copy of a running message), and
        ``"acquired"`` also when the lock holds ``token`` or one of ``earlier_tokens`` (attempts of
        this delivery whose reply was lost): the lock is taken over with its fence.

        The lease counts from when the request was sent (``sent_at``), as every renewal's does: an
        answer that comes later than ``LEASE_LATE_REPLY_SHARE`` of ``ttl`` after it was sent may
        describe a lease that has ended, or will before the first renewal; the lock is released and
        :attr:`unavailable` raised, as for a backend that did not answer.
        """
        sent_at = self.lease_clock()
        acquired = self._acquire_lease(key, token, ttl, owner, marker, earlier_tokens)
        if acquired.status != "acquired":
            return acquired
        waited = self.lease_clock() - sent_at
        if waited <= ttl * C.LEASE_LATE_REPLY_SHARE:
            return acquired._replace(sent_at=sent_at)
        try:
            self.release(key, token)
        except Exception as exc:  # it expires by itself, if it has not already
            logger.warning("could not release lock %r after its late acquire on %s: %s", key, self.label, exc)
        raise self.unavailable(
            f"the acquire of lock {key!r} was answered {waited:.2f}s after it was sent, more than "
            f"{C.LEASE_LATE_REPLY_SHARE:.0%} of its {ttl:g}s lease: the lock may have expired on {self.label} "
            "meanwhile, so it is not held (released)"
        )

    @abc.abstractmethod
    def _acquire_lease(
        self, key: str, token: str, ttl: float, owner: Owner, marker: str | None, earlier_tokens: tuple[str, ...]
    ) -> Acquired:
        """The backend's own acquire, which :meth:`acquire` dates from the send."""

    @abc.abstractmethod
    def renew(self, key: str, token: str, ttl: float) -> bool:
        """Extend the lock to ``ttl`` from now if ``token`` still owns it."""

    @abc.abstractmethod
    def release(self, key: str, token: str, finished: tuple[str, float, str] | None = None) -> bool:
        """Delete the lock if ``token`` still owns it; False when it expired or has another owner.

        ``finished`` = (identity, ttl, task id) also records that delivery as ended for ``ttl``
        seconds, whether or not the lock was still ours.
        """

    @abc.abstractmethod
    def commit(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None = None
    ) -> tuple[bool, bool]:
        """Record idempotency ``marker`` for ``window`` and release ``lock``: (recorded, released).

        ``finished`` = (identity, ttl) records the delivery as ended, as :meth:`release` does.
        ``recorded`` is also True when the marker already holds ``token`` (a retry of this commit).
        """

    def release_later(self, key: str, token: str, finished: tuple[str, float, str] | None, settle: Settle) -> None:
        """:meth:`release`, with its answer given to ``settle(released, None)`` (or ``settle(None, error)``)
        when it is known: here at once; the Redis backend sends it and reads the answer before its next
        call on this thread, so a task does not wait for it (``redis_wire``'s module doc)."""
        settle_with(settle, lambda: self.release(key, token, finished))

    def commit_later(
        self,
        lock: str,
        marker: str,
        token: str,
        window: float,
        task_id: str,
        finished: tuple[str, float] | None,
        settle: Settle,
    ) -> None:
        """:meth:`commit`, with its answer, ``(recorded, released)``, given to ``settle`` as
        :meth:`release_later` gives its own."""
        settle_with(settle, lambda: self.commit(lock, marker, token, window, task_id, finished))

    def token_of(self, key: str) -> str | None:
        """The token that holds ``key`` now (None: free)."""
        record = self.holder_record(key)
        return record[0] if record is not None else None

    @abc.abstractmethod
    def idempotent_done(self, key: str) -> bool:
        """Whether an ``idempotent`` key has run (its marker is within its window)."""

    @abc.abstractmethod
    def holder_record(self, key: str) -> HolderRecord | None:
        """(token, task id, host, pid) of ``key``'s holder, or None when it is free."""

    # --- unique task keys -------------------------------------------------------------------------
    def unique_acquire(
        self,
        key: str,
        task_id: str,
        ttl: float,
        state: str,
        *,
        stored: bool | None,
        host: str,
        gone: str | None = None,
        own: bool = False,
    ) -> UniqueClaim:
        """Take the unique ``key`` for ``task_id`` unless another task holds it.

        ``gone``: a holder the caller found gone (its stored row ended): replaced if it still holds
        the key. ``own``: ``task_id`` is the caller itself (its retry, or its run starting): a key it
        holds is refreshed (``state``, ``ttl``; ``stored`` unless None) instead of conflicting.
        """
        return self._unique_acquire(key, task_id, ttl, state, stored, host, gone, own)

    @abc.abstractmethod
    def _unique_acquire(
        self, key: str, task: str, ttl: float, state: str, stored: bool | None, host: str, gone: str | None, own: bool
    ) -> UniqueClaim:
        """The backend's own :meth:`unique_acquire`."""

    @abc.abstractmethod
    def unique_release(self, key: str, task_id: str) -> bool:
        """Delete the unique ``key`` if ``task_id`` holds it."""

    @abc.abstractmethod
    def unique_info(self, key: str, now: float) -> LockInfo | None:
        """The unique ``key``'s holder as ``locks list`` shows it, or None when it is free."""

    @abc.abstractmethod
    def scan_unique(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        """Held unique keys matching ``pattern`` (glob over the key without ``unique:``)."""

    @abc.abstractmethod
    def force_release_unique(self, key: str) -> LockInfo | None:
        """Delete the unique ``key`` whoever holds it (operator action); returns what was released."""

    # --- rate limits ------------------------------------------------------------------------------
    @abc.abstractmethod
    def rate_take(self, key: str, token: str, rate: Rate, *, reserve: bool = True) -> RateTaken:
        """Admit one call of the ``rate_limit`` ``key`` under ``rate`` (:func:`..rates.take`'s sliding
        log, on the backend's clock), or reserve it the first free place and say in how many seconds
        it is due; ``token`` is the call's reservation (a new one for a first attempt)."""

    @abc.abstractmethod
    def rate_release(self, key: str, token: str) -> bool:
        """Give up the reservation ``token`` holds on the ``rate_limit`` ``key``'s line (a call dropped
        before it used its place), so the places behind it are not kept waiting for a call that never
        comes; an admitted call's entry is never touched. Returns whether there was one."""

    @abc.abstractmethod
    def rate_counts(self, pattern: str = "*", *, limit: int | None = None) -> list[RateCount]:
        """``rate_limit`` keys matching ``pattern`` (glob) with calls in their window or waiting, by key;
        at most ``limit`` of them (the operator view: SCAN with a cap on Redis, one bounded query on
        PostgreSQL)."""

    def rate_wait(self, seconds: float) -> None:
        """Wait out the last ``seconds`` before a reservation is due (a call re-queued to come back a
        little early, ``RATE_LEAD``), on the clock ``rate_take`` reads: the real one but in tests."""
        time.sleep(seconds)

    # --- operator view ----------------------------------------------------------------------------
    @abc.abstractmethod
    def info(self, redis_key: str, now: float) -> LockInfo | None:
        """The lock stored under ``redis_key`` (a full key name), or None when it is gone."""

    @abc.abstractmethod
    def scan(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        """Held locks whose key matches ``pattern`` (glob), sorted by key."""

    @abc.abstractmethod
    def force_release(self, key: str) -> LockInfo | None:
        """Delete ``key``'s lock whoever holds it (operator action); returns what was released."""

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing of their own
        """Give back what this backend holds (connections); the default holds nothing."""
