"""Overlap locks, idempotency markers and unique keys on dicts in this process: the testing
plugin's lock store (:func:`celery_safe_time.testing.safe_time_testing`) and the unit tests'.

It follows the Redis scripts' rules (``locks/lua/*.lua``) call for call; the backend behaviour tests
run it beside Redis and PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ...config import SafeTimeConfig
from ..rates import Rate, RateTaken, take
from .base import Acquired, Holder, HolderRecord, LockBackend, LockInfo, Owner, RateCount, UniqueClaim


@dataclasses.dataclass
class _Lock:
    token: str
    task_id: str
    identity: str
    host: str
    pid: int
    fence: int
    acquired_at: float
    expires: float


@dataclasses.dataclass
class _Unique:
    task_id: str
    state: str
    stored: bool
    host: str
    created_at: float
    expires: float


_Held = TypeVar("_Held", _Lock, _Unique)


class MemoryLockBackend(LockBackend):
    """The lock scripts' rules (``locks/lua/*.lua``) on dicts in this process, for tests.

    Expiry follows ``clock`` (``time.time`` by default); fencing numbers start at the clock in
    microseconds, as the acquire script seeds them. Rate-limit windows follow ``rate_clock`` (default:
    ``clock``), and a call waiting out its last moments before its place (``rate_wait``) calls
    ``rate_sleep`` (default: ``time.sleep``): the testing kit moves both with its test clock.
    """

    kind = "memory"
    label = "memory"

    def __init__(
        self,
        config: SafeTimeConfig,
        clock: Any = time.time,
        *,
        rate_clock: Callable[[], float] | None = None,
        rate_sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._rate_clock: Callable[[], float] = rate_clock or (lambda: self._clock())
        self._rate_sleep: Callable[[float], None] = rate_sleep or time.sleep
        self._mutex = threading.RLock()
        self._locks: dict[str, _Lock] = {}
        self._fences: dict[str, int] = {}
        self._markers: dict[str, tuple[float, str, str]] = {}  # marker key -> (expires, task id, token)
        self._done: dict[str, float] = {}  # finished-delivery key -> expires
        self._unique: dict[str, _Unique] = {}  # unique task key -> holder
        self._rates: dict[str, list[tuple[float, str]]] = {}  # rate key -> its line: (place, member)
        self._rate_starts: dict[str, list[tuple[float, str]]] = {}  # rate key -> (real start, member)
        self._periods: dict[str, float] = {}  # rate key -> the period its last call was taken with

    def _live(self, table: dict[str, _Held], key: str) -> _Held | None:
        held = table.get(key)
        if held is not None and held.expires <= self._clock():
            del table[key]
            return None
        return held

    def _alive(self, table: dict[str, Any], key: str) -> bool:
        entry = table.get(key)
        if entry is None:
            return False
        expires = entry[0] if isinstance(entry, tuple) else entry
        if expires <= self._clock():
            del table[key]
            return False
        return True

    def _acquire_lease(
        self, key: str, token: str, ttl: float, owner: Owner, marker: str | None, earlier_tokens: tuple[str, ...]
    ) -> Acquired:
        with self._mutex:
            now = self._clock()
            if marker is not None and self._alive(self._markers, self.marker_key(marker)):
                return Acquired("done")
            if self._alive(self._done, self.done_key(key, owner.identity)):
                return Acquired("finished")
            lock_key = self.lock_key(key)
            current = self._live(self._locks, lock_key)
            if current is not None:
                if current.token == token or current.token in earlier_tokens:
                    self._locks[lock_key] = dataclasses.replace(
                        current,
                        token=token,
                        task_id=owner.task_id,
                        identity=owner.identity,
                        host=owner.host,
                        pid=owner.pid,
                        expires=now + ttl,
                    )
                    return Acquired("acquired", fence=current.fence, took_over=True)
                holder = Holder(task_id=current.task_id, host=current.host, pid=current.pid, fence=current.fence)
                return Acquired("duplicate" if current.identity == owner.identity else "held", holder=holder)
            fence_key = self.fence_key(key)
            fence = self._fences.get(fence_key, int(now * 1_000_000)) + 1
            self._fences[fence_key] = fence
            self._locks[lock_key] = _Lock(
                token, owner.task_id, owner.identity, owner.host, owner.pid, fence, now, now + ttl
            )
            return Acquired("acquired", fence=fence)

    def renew(self, key: str, token: str, ttl: float) -> bool:
        with self._mutex:
            lock = self._live(self._locks, self.lock_key(key))
            if lock is None or lock.token != token:
                return False
            lock.expires = self._clock() + ttl
            return True

    def release(self, key: str, token: str, finished: tuple[str, float, str] | None = None) -> bool:
        with self._mutex:
            if finished is not None:
                identity, ttl, _task_id = finished
                self._done[self.done_key(key, identity)] = self._clock() + ttl
            return self._drop(key, token)

    def _drop(self, key: str, token: str) -> bool:
        lock_key = self.lock_key(key)
        lock = self._live(self._locks, lock_key)
        if lock is None or lock.token != token:
            return False
        del self._locks[lock_key]
        return True

    def commit(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None = None
    ) -> tuple[bool, bool]:
        with self._mutex:
            marker_key = self.marker_key(marker)
            if self._alive(self._markers, marker_key):
                recorded = self._markers[marker_key][2] == token
            else:
                self._markers[marker_key] = (self._clock() + window, task_id, token)
                recorded = True
            if finished is not None:
                identity, done_ttl = finished
                self._done[self.done_key(lock, identity)] = self._clock() + done_ttl
            return recorded, self._drop(lock, token)

    def holder_record(self, key: str) -> HolderRecord | None:
        with self._mutex:
            lock = self._live(self._locks, self.lock_key(key))
            return (lock.token, lock.task_id, lock.host, lock.pid) if lock is not None else None

    def info(self, redis_key: str, now: float) -> LockInfo | None:
        with self._mutex:
            lock = self._live(self._locks, redis_key)
            if lock is None:
                return None
            return LockInfo(
                key=self.user_key(redis_key),
                redis_key=redis_key,
                task_id=lock.task_id,
                host=lock.host,
                pid=lock.pid,
                fence=lock.fence,
                age=round(now - lock.acquired_at, 3),
                ttl_left=round(lock.expires - now, 3),
            )

    def scan(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        now = self._clock()
        with self._mutex:
            keys = [k for k in list(self._locks) if fnmatch.fnmatchcase(k, self.lock_key(pattern))]
            found = [info for info in (self.info(k, now) for k in keys) if info is not None]
        found.sort(key=lambda i: i.key)
        return found[:limit] if limit is not None else found

    def force_release(self, key: str) -> LockInfo | None:
        with self._mutex:
            info = self.info(self.lock_key(key), self._clock())
            self._locks.pop(self.lock_key(key), None)
            return info

    # --- unique task keys (``unique_acquire.lua`` / ``unique_release.lua``) ----------------------
    def _unique_acquire(
        self, key: str, task: str, ttl: float, state: str, stored: bool | None, host: str, gone: str | None, own: bool
    ) -> UniqueClaim:
        with self._mutex:
            now = self._clock()
            held = self._live(self._unique, key)
            if held is not None:
                if held.task_id == task and own:
                    held.state, held.host, held.expires = state, host, now + ttl
                    if stored is not None:
                        held.stored = stored
                    return UniqueClaim("own")
                if gone is None or held.task_id != gone:
                    return UniqueClaim(
                        "held", holder=held.task_id, state=held.state, stored=held.stored, ttl_left=held.expires - now
                    )
            self._unique[key] = _Unique(task, state, bool(stored), host, now, now + ttl)
            return UniqueClaim("acquired")

    def unique_release(self, key: str, task_id: str) -> bool:
        with self._mutex:
            held = self._live(self._unique, key)
            if held is None or held.task_id != task_id:
                return False
            del self._unique[key]
            return True

    def unique_info(self, key: str, now: float) -> LockInfo | None:
        with self._mutex:
            held = self._live(self._unique, key)
            if held is None:
                return None
            age, ttl_left = round(now - held.created_at, 3), round(held.expires - now, 3)
            return LockInfo.unique(key, self.unique_key(key), held.task_id, held.host, age, ttl_left, held.state)

    def scan_unique(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        with self._mutex:
            now = self._clock()
            found = [
                info
                for key in sorted(self._unique)
                if fnmatch.fnmatchcase(key, pattern) and (info := self.unique_info(key, now)) is not None
            ]
            return found[:limit] if limit is not None else found

    def force_release_unique(self, key: str) -> LockInfo | None:
        with self._mutex:
            info = self.unique_info(key, self._clock())
            self._unique.pop(key, None)
            return info

    def idempotent_done(self, key: str) -> bool:
        with self._mutex:
            return self._alive(self._markers, self.marker_key(key))

    # --- rate limits (``rate_take.lua``) ------------------------------------------------------------
    def rate_take(self, key: str, token: str, rate: Rate, *, reserve: bool = True) -> RateTaken:
        with self._mutex:
            line = self._rates.setdefault(self.rate_key(key), [])
            starts = self._rate_starts.setdefault(self.rate_key(key), [])
            self._periods[self.rate_key(key)] = rate.period
            return take(line, starts, self._rate_clock(), rate, token, reserve=reserve)

    def rate_release(self, key: str, token: str) -> bool:
        with self._mutex:
            line = self._rates.get(self.rate_key(key), [])
            kept = [entry for entry in line if entry[1] != token]
            found = len(kept) != len(line)
            line[:] = kept
            return found

    def rate_wait(self, seconds: float) -> None:
        self._rate_sleep(seconds)

    def rate_counts(self, pattern: str = "*", *, limit: int | None = None) -> list[RateCount]:
        now = self._rate_clock()
        found: list[RateCount] = []
        with self._mutex:
            head = self.rate_key("")
            for redis_key, log in sorted(self._rates.items()):
                key = redis_key[len(head) :] if redis_key.startswith(head) else redis_key
                if not fnmatch.fnmatchcase(key, pattern):
                    continue
                since = now - self._periods.get(redis_key, 0.0)
                started = sum(1 for at, _ in self._rate_starts.get(redis_key, ()) if since < at <= now)
                waiting = sum(1 for _, member in log if "@" not in member)
                if started or waiting:
                    found.append(RateCount(key, started, waiting))
        return found[:limit] if limit is not None else found
