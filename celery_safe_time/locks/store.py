"""Overlap locks in Redis: acquire, renew, release and commit as Lua scripts (``locks/lua/*.lua``)
comparing a token.

A lock is a hash ``<prefix>lock:<key>`` with fields ``token`` (random per acquire attempt, never
shown), ``task_id``, ``identity`` (one delivery of one message: its ``safe_time_attempt`` header,
kept across our re-queues), ``host``, ``pid``, ``fence``, ``acquired_at``, ``renewed_at`` (Redis
``TIME``) and ``ttl_ms``; the hash expires after the lock's ttl unless renewed. The fencing number
comes from ``INCR`` on ``<prefix>lock-fence:<key>``, which never expires; a missing counter (a new
key, or a Redis that lost its data) is first seeded with Redis ``TIME`` in microseconds, so fences
keep increasing across holders and across a Redis reset. Every write that assumes ownership checks
the token inside the script, so a holder whose lock expired can never renew or delete the next
holder's lock. When a delivery ends, ``<prefix>lock-done:<key>:<identity>`` records it for a while,
so a late broker redelivery of that very message is dropped instead of run again.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import weakref
from typing import Any, Literal

import redis
from celery import Celery

from .. import constants as C
from ..config import SafeTimeConfig, get_config
from ..redis_client import as_text, get_redis, load_script

SCRIPTS = ("acquire", "renew", "release", "commit", "unique_acquire", "unique_release")

AcquireStatus = Literal["acquired", "held", "duplicate", "done", "finished"]


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who asks for a lock: one delivery of one task message in one process."""

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


@dataclasses.dataclass(frozen=True)
class Acquired:
    """Result of :meth:`LockStore.acquire`; ``fence`` is set when ``status == "acquired"``.

    ``took_over`` is True when the lock was already ours (a token of this delivery whose reply was
    lost): the caller now holds it with the fence that attempt was given.
    """

    status: AcquireStatus
    fence: int | None = None
    holder: Holder | None = None
    took_over: bool = False


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


UniqueStatus = Literal["acquired", "own", "held"]


@dataclasses.dataclass(frozen=True)
class UniqueClaim:
    """Result of :meth:`LockStore.unique_acquire`; ``holder`` and the rest are set when ``"held"``."""

    status: UniqueStatus
    holder: str | None = None
    state: str | None = None
    #: The holder is a stored delay: its row in the store says whether it is gone.
    stored: bool = False
    ttl_left: float | None = None


def _int(value: Any) -> int | None:
    text = as_text(value)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class LockStore:
    """The lock scripts bound to one Redis client and one app's key prefix."""

    def __init__(self, client: redis.Redis, config: SafeTimeConfig) -> None:
        self.client = client
        self.config = config
        scripts = {name: client.register_script(load_script(__package__, name)) for name in SCRIPTS}
        self._acquire = scripts["acquire"]
        self._renew = scripts["renew"]
        self._release = scripts["release"]
        self._commit = scripts["commit"]
        self._unique_acquire = scripts["unique_acquire"]
        self._unique_release = scripts["unique_release"]

    # --- key names -------------------------------------------------------------
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

    def user_key(self, redis_key: str) -> str:
        """``<prefix>lock:<key>`` (``<prefix>lock:{<key>}`` on a cluster) -> ``<key>``."""
        head = self.config.key_prefix + C.KEY_LOCK.format(key="")
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

    # --- ownership scripts -----------------------------------------------------
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
        """
        keys = [self.lock_key(key), self.fence_key(key), self.done_key(key, owner.identity)]
        if marker is not None:
            keys.append(self.marker_key(marker))
        args: list[str | int] = [token, _ms(ttl), owner.task_id, owner.host, owner.pid, owner.identity, *earlier_tokens]
        reply = self._acquire(keys=keys, args=args)
        status = as_text(reply[0])
        if status == "acquired":
            return Acquired("acquired", fence=int(reply[1]), took_over=as_text(reply[2]) == "own")
        if status in ("done", "finished"):
            return Acquired("done" if status == "done" else "finished")
        holder = Holder(task_id=as_text(reply[1]), host=as_text(reply[2]), pid=_int(reply[3]), fence=_int(reply[4]))
        return Acquired("duplicate" if status == "duplicate" else "held", holder=holder)

    def renew(self, key: str, token: str, ttl: float) -> bool:
        """Extend the lock to ``ttl`` from now if ``token`` still owns it."""
        return bool(self._renew(keys=[self.lock_key(key)], args=[token, _ms(ttl)]))

    def release(self, key: str, token: str, finished: tuple[str, float, str] | None = None) -> bool:
        """Delete the lock if ``token`` still owns it; False when it expired or has another owner.

        ``finished`` = (identity, ttl, task id) also records that delivery as ended for ``ttl``
        seconds, whether or not the lock was still ours.
        """
        if finished is None:
            return bool(self._release(keys=[self.lock_key(key)], args=[token]))
        identity, ttl, task_id = finished
        keys = [self.lock_key(key), self.done_key(key, identity)]
        return bool(self._release(keys=keys, args=[token, _ms(ttl), task_id]))

    def commit(
        self,
        lock: str,
        marker: str,
        token: str,
        window: float,
        task_id: str,
        finished: tuple[str, float] | None = None,
    ) -> tuple[bool, bool]:
        """Record idempotency ``marker`` for ``window`` and release ``lock``: (recorded, released).

        ``finished`` = (identity, ttl) records the delivery as ended, as :meth:`release` does.
        ``recorded`` is also True when the marker already holds ``token`` (a retry of this commit).
        """
        keys = [self.lock_key(lock), self.marker_key(marker)]
        args: list[str | int] = [token, _ms(window), task_id]
        if finished is not None:
            identity, done_ttl = finished
            keys.append(self.done_key(lock, identity))
            args.append(_ms(done_ttl))
        reply = self._commit(keys=keys, args=args)
        return bool(int(reply[0])), bool(int(reply[1]))

    def token_of(self, key: str) -> str | None:
        return as_text(self.client.hget(self.lock_key(key), "token"))

    # --- operator view ---------------------------------------------------------
    # --- unique task keys (one key per script call: <prefix>unique:<key>) ------------------------
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
        flag = "" if stored is None else ("1" if stored else "0")
        args: list[str | int] = [task_id, _ms(ttl), state, flag, host, gone or "", "1" if own else "0"]
        reply = self._unique_acquire(keys=[self.unique_key(key)], args=args)
        status = as_text(reply[0])
        if status == "acquired":
            return UniqueClaim("acquired")
        if status == "own":
            return UniqueClaim("own")
        pttl = int(reply[4])
        return UniqueClaim(
            "held",
            holder=as_text(reply[1]),
            state=as_text(reply[2]) or None,
            stored=as_text(reply[3]) == "1",
            ttl_left=pttl / 1000.0 if pttl >= 0 else None,
        )

    def unique_release(self, key: str, task_id: str) -> bool:
        """Delete the unique ``key`` if ``task_id`` holds it."""
        return bool(self._unique_release(keys=[self.unique_key(key)], args=[task_id]))

    def unique_info(self, key: str, now: float) -> LockInfo | None:
        """The unique ``key``'s holder as ``locks list`` shows it, or None when it is free."""
        redis_key = self.unique_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(redis_key, ["task_id", "host", "state", "created_at"])
        pipe.pttl(redis_key)
        fields, pttl = pipe.execute()
        if pttl == -2 or not any(fields):
            return None
        task_id, host, state, created_at = (as_text(v) for v in fields)
        return LockInfo(
            key=C.UNIQUE_LIST_PREFIX + key,
            redis_key=redis_key,
            task_id=task_id,
            host=host,
            pid=None,
            fence=None,
            age=round(now - float(created_at), 3) if created_at else None,
            ttl_left=round(pttl / 1000.0, 3) if pttl >= 0 else None,
            kind="unique",
            state=state,
        )

    def scan_unique(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        """Held unique keys matching ``pattern`` (glob over the key without ``unique:``), by SCAN."""
        seconds, micros = self.client.time()
        now = float(seconds) + float(micros) / 1e6
        head = self.unique_key("")
        found: list[LockInfo] = []
        for raw in self.client.scan_iter(match=self.unique_key(pattern), count=C.LOCK_SCAN_COUNT, _type="hash"):
            info = self.unique_info((as_text(raw) or "")[len(head) :], now)
            if info is not None:
                found.append(info)
                if limit is not None and len(found) >= limit:
                    break
        found.sort(key=lambda i: i.key)
        return found

    def force_release_unique(self, key: str) -> LockInfo | None:
        """Delete the unique ``key`` whoever holds it (operator action); returns what was released."""
        seconds, micros = self.client.time()
        info = self.unique_info(key, float(seconds) + float(micros) / 1e6)
        if info is not None:
            self.client.delete(self.unique_key(key))
        return info

    def info(self, redis_key: str, now: float) -> LockInfo | None:
        """The lock stored at ``redis_key`` (a full key), or None when it is gone."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(redis_key, ["task_id", "host", "pid", "fence", "acquired_at"])
        pipe.pttl(redis_key)
        fields, pttl = pipe.execute()
        if pttl == -2 or not any(fields):
            return None
        task_id, host, pid, fence, acquired_at = fields
        acquired = as_text(acquired_at)
        return LockInfo(
            key=self.user_key(redis_key),
            redis_key=redis_key,
            task_id=as_text(task_id),
            host=as_text(host),
            pid=_int(pid),
            fence=_int(fence),
            age=round(now - float(acquired), 3) if acquired else None,
            ttl_left=round(pttl / 1000.0, 3) if pttl >= 0 else None,
        )

    def scan(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        """Held locks whose key matches ``pattern`` (glob), found with SCAN, never KEYS."""
        seconds, micros = self.client.time()
        now = float(seconds) + float(micros) / 1e6
        found: list[LockInfo] = []
        # On a cluster the key part is braced (``lock:{k}``, ``lock:idem:{k}``): SCAN every lock there
        # and match the pattern against the user's key (Redis glob and fnmatch agree on * ? [...]).
        match = (
            self.config.key_prefix + C.KEY_LOCK.format(key="*") if self.config.redis_cluster else self.lock_key(pattern)
        )
        for raw in self.client.scan_iter(match=match, count=C.LOCK_SCAN_COUNT, _type="hash"):
            redis_key = as_text(raw) or ""
            if self.config.redis_cluster and not fnmatch.fnmatchcase(self.user_key(redis_key), pattern):
                continue
            info = self.info(redis_key, now)
            if info is not None:
                found.append(info)
                if limit is not None and len(found) >= limit:
                    break
        found.sort(key=lambda i: i.key)
        return found

    def force_release(self, key: str) -> LockInfo | None:
        """Delete ``key``'s lock whoever holds it (operator action); returns what was released."""
        seconds, micros = self.client.time()
        info = self.info(self.lock_key(key), float(seconds) + float(micros) / 1e6)
        if info is not None:
            self.client.delete(self.lock_key(key))
        return info


_stores: dict[tuple[int, int, SafeTimeConfig], LockStore] = {}

#: Per app, a lock store that replaces Redis (``celery_safe_time.testing``'s in-process one).
_overrides: weakref.WeakKeyDictionary[Celery, LockStore] = weakref.WeakKeyDictionary()


def use_lock_store(app: Celery, store: LockStore | None) -> None:
    """Make ``app`` use ``store`` for its locks (None: back to Redis). For tests: production never calls it."""
    if store is None:
        _overrides.pop(app, None)
    else:
        _overrides[app] = store


def get_lock_store(app: Celery) -> LockStore:
    """The lock scripts on this process's Redis client for ``app``'s settings."""
    override = _overrides.get(app)
    if override is not None:
        return override
    config = get_config(app)
    client = get_redis(config.redis_url)
    cache_key = (os.getpid(), id(client), config)
    store = _stores.get(cache_key)
    if store is None:
        store = _stores[cache_key] = LockStore(client, config)
    return store
