"""Exceptions raised by celery-safe-time; all derive from :class:`SafeTimeError`."""

from __future__ import annotations


class SafeTimeError(Exception):
    """Raised when anything in celery-safe-time fails; the base of every other exception here."""


class ImproperlyConfigured(SafeTimeError, ValueError):
    """Raised when a ``safe_time_*`` setting is missing or invalid; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class CoordinationUnavailable(SafeTimeError, ConnectionError):
    """Raised when the backend that holds leases, locks and unique keys cannot be reached: Redis
    (:class:`RedisUnavailable`) or the PostgreSQL database of ``safe_time_coordination_url``; the
    message names it. A ``ConnectionError``, so code that handles an unreachable server handles it too."""


class RedisUnavailable(CoordinationUnavailable):
    """Raised when the Redis that holds leases and locks (``safe_time_redis_url``) cannot be reached."""


class StoreError(SafeTimeError):
    """Raised when the delayed-task store cannot be reached or refuses a write."""

    #: The position of the delay that was refused, when one of a batch (``insert_many``) was.
    index: int | None = None


class PurgeRefused(SafeTimeError, ValueError):
    """Raised when a purge is asked to delete unfinished (pending, claimed) rows or given bad arguments."""


class SerializationError(SafeTimeError, TypeError):
    """Raised when a delayed task's arguments cannot be encoded with its serializer."""


class LockConflict(SafeTimeError):
    """Raised when an overlap lock is held by another run and ``on_conflict="raise"``."""

    def __init__(self, key: str, holder: str | None = None) -> None:
        self.key = key
        self.holder = holder
        super().__init__(f"overlap lock {key!r} is held" + (f" by {holder}" if holder else ""))


class RateLimited(SafeTimeError):
    """Raised when a ``rate_limit``ed call is over its limit where it cannot be delayed (a direct or
    eager call; in a worker the call is re-queued instead). ``wait``: seconds until the limit frees."""

    def __init__(self, key: str, wait: float, rate: str) -> None:
        self.key = key
        self.wait = wait
        self.rate = rate
        super().__init__(f"rate limit {key!r} ({rate}) is full; a place frees in {wait:.3f}s")


class UniqueConflict(SafeTimeError):
    """Raised when a unique task's key is held by another queued or running copy and
    ``unique_on_conflict="raise"``; ``holder`` is that copy's task id, ``state`` where it is."""

    def __init__(self, key: str, holder: str | None = None, state: str | None = None) -> None:
        self.key = key
        self.holder = holder
        self.state = state
        where = f" ({state})" if state else ""
        super().__init__(f"unique key {key!r} is held" + (f" by task {holder}{where}" if holder else ""))


class LockLost(SafeTimeError):
    """Raised when an overlap lock could not be renewed while its task was running."""


class RunCancelled(SafeTimeError):
    """Raised in a run of a beat entry (overlap policy ``cancel_other``) when a newer slot of the
    entry terminated it (SIGTERM to its pool process): the run unwinds, releases the entry's lease,
    and the newer run starts."""


class LeaseLost(SafeTimeError):
    """Raised when the beat leader discovers it no longer holds the lease."""


class ScheduleError(SafeTimeError, ValueError):
    """Raised when a schedule entry, crontab field or timezone is invalid."""


class NotInstalled(SafeTimeError):
    """Raised when an optional part (an extra or a later feature) is used but not available."""


class DecoratorOrderError(SafeTimeError, TypeError):
    """Raised when ``@overlap_lock`` or ``@idempotent`` is stacked above ``@app.task`` instead of below it."""


class BulkItemError(SafeTimeError, ValueError):
    """Raised when one call of ``SafeTask.apply_many`` is invalid and its own error cannot be re-raised
    naming it; ``index`` is the call's position, ``error`` the original. Nothing of the batch was stored."""

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.error = error
        super().__init__(f"apply_many item {index}: {error.__class__.__name__}: {error}")


class DebounceError(SafeTimeError, ValueError):
    """Raised at the call site when a debounced call's options are wrong: no key, a key template naming
    an argument the call lacks, a period shorter than the sweep interval, a max wait shorter than the
    period, or an option debounce cannot be combined with."""
