"""Overlap locks in Redis: acquire, renew, release and commit as Lua scripts (``locks/lua/*.lua``)
comparing a token.

A lock is a hash ``<prefix>lock:<key>`` with fields ``token`` (random per acquire attempt, never
shown), ``task_id``, ``identity`` (one delivery of one message: its ``safe_time_attempt`` header,
kept across our re-queues), ``host``, ``pid``, ``fence``, ``acquired_at``, ``renewed_at`` (Redis
``TIME``) and ``ttl_ms``; the hash expires after the lock's ttl unless renewed. The fencing number
comes from ``INCR`` on ``<prefix>lock-fence:<key>``, which expires with the lock's ttl and is
extended by each renewal, as the lock is (so a key nobody locks again leaves nothing behind); a
missing counter (a new or expired key, or a Redis that lost its data) is first seeded with Redis
``TIME`` in microseconds, so fences keep increasing across holders, across the counter's expiry and
across a Redis reset. Every write that assumes ownership checks the token inside the script, so a
holder whose lock expired can never renew or delete the next holder's lock. When a delivery ends,
``<prefix>lock-done:<key>:<identity>`` records it for a while, so a late broker redelivery of that
very message is dropped instead of run again.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import redis

from ... import constants as C
from ...config import SafeTimeConfig, mask_url
from ...exceptions import RedisUnavailable
from ...redis_client import as_text, glob_escape, load_script
from ..rates import Rate, RateTaken
from ..redis_wire import LeanLink, LeanScript, Settle
from .base import (
    Acquired,
    Holder,
    HolderRecord,
    LockBackend,
    LockInfo,
    Owner,
    RateCount,
    UniqueClaim,
    as_int,
    as_ms,
)

#: ``locks list`` and the status section scan this many keys per SCAN call.
LOCK_SCAN_COUNT = 500

#: The scripts live in ``celery_safe_time/locks/lua/`` (package data of ``celery_safe_time.locks``).
SCRIPTS = ("acquire", "renew", "release", "commit", "unique_acquire", "unique_release", "rate_take")
SCRIPT_PACKAGE = "celery_safe_time.locks"


def _commit_answer(reply: list[int]) -> tuple[bool, bool]:
    """The commit script's reply as (recorded, released)."""
    return bool(int(reply[0])), bool(int(reply[1]))


class RedisLockBackend(LockBackend):
    """The lock scripts bound to one Redis client and one app's key prefix."""

    kind = "redis"
    label = "Redis"
    unavailable = RedisUnavailable

    def __init__(self, client: redis.Redis, config: SafeTimeConfig) -> None:
        self.client = client
        self.config = config
        # The names the per-task scripts touch, each one call (LockBackend's methods give the same).
        self._lock_name = config.key_maker(C.KEY_LOCK)
        self._fence_name = config.key_maker(C.KEY_LOCK_FENCE)
        self._done_name = config.key_maker(C.KEY_LOCK_DONE)
        sources = {name: load_script(SCRIPT_PACKAGE, name) for name in SCRIPTS}
        # The calls every locked task makes (acquire, then release or commit) take the lean path, on
        # one kept connection per thread; renewals run on the background thread, unique keys at
        # publish time: redis-py's path.
        link = LeanLink(client)
        self._acquire = LeanScript(client, sources["acquire"], link)
        self._release = LeanScript(client, sources["release"], link)
        self._commit = LeanScript(client, sources["commit"], link)
        self._rate_take = LeanScript(client, sources["rate_take"], link)
        plain = ("renew", "unique_acquire", "unique_release")
        scripts = {name: client.register_script(sources[name]) for name in plain}
        self._renew = scripts["renew"]
        self._unique_script = scripts["unique_acquire"]
        self._unique_release = scripts["unique_release"]

    # --- ownership scripts -----------------------------------------------------
    def _acquire_lease(
        self, key: str, token: str, ttl: float, owner: Owner, marker: str | None, earlier_tokens: tuple[str, ...]
    ) -> Acquired:
        keys = [self._lock_name(key=key), self._fence_name(key=key), self._done_name(key=key, identity=owner.identity)]
        if marker is not None:
            keys.append(self.marker_key(marker))
        args: list[str | int] = [token, as_ms(ttl), owner.task_id, owner.host, owner.pid, owner.identity]
        args += earlier_tokens
        reply = self._acquire(keys=keys, args=args)
        status = as_text(reply[0])
        if status == "acquired":
            return Acquired("acquired", fence=int(reply[1]), took_over=as_text(reply[2]) == "own")
        if status in ("done", "finished"):
            return Acquired("done" if status == "done" else "finished")
        holder = Holder(task_id=as_text(reply[1]), host=as_text(reply[2]), pid=as_int(reply[3]), fence=as_int(reply[4]))
        return Acquired("duplicate" if status == "duplicate" else "held", holder=holder)

    def renew(self, key: str, token: str, ttl: float) -> bool:
        keys = [self._lock_name(key=key), self._fence_name(key=key)]
        return bool(self._renew(keys=keys, args=[token, as_ms(ttl)]))

    def release(self, key: str, token: str, finished: tuple[str, float, str] | None = None) -> bool:
        return bool(self._release(*self._release_call(key, token, finished)))

    def release_later(self, key: str, token: str, finished: tuple[str, float, str] | None, settle: Settle) -> None:
        """:meth:`release` sent without waiting: ``settle`` gets its answer after the task, from the
        worker's post-run step (at once where the lean path does not apply)."""
        keys, args = self._release_call(key, token, finished)
        self._release.post(keys, args, lambda reply, error: settle(None if error else bool(reply), error))

    def _release_call(
        self, key: str, token: str, finished: tuple[str, float, str] | None
    ) -> tuple[list[str], list[str | int]]:
        if finished is None:
            return [self._lock_name(key=key)], [token]
        identity, ttl, task_id = finished
        keys = [self._lock_name(key=key), self._done_name(key=key, identity=identity)]
        return keys, [token, as_ms(ttl), task_id]

    def commit(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None = None
    ) -> tuple[bool, bool]:
        return _commit_answer(self._commit(*self._commit_call(lock, marker, token, window, task_id, finished)))

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
        """:meth:`commit` sent without waiting, as :meth:`release_later` is."""
        keys, args = self._commit_call(lock, marker, token, window, task_id, finished)
        self._commit.post(keys, args, lambda reply, error: settle(None if error else _commit_answer(reply), error))

    def _commit_call(
        self, lock: str, marker: str, token: str, window: float, task_id: str, finished: tuple[str, float] | None
    ) -> tuple[list[str], list[str | int]]:
        keys = [self.lock_key(lock), self.marker_key(marker)]
        args: list[str | int] = [token, as_ms(window), task_id]
        if finished is not None:
            identity, done_ttl = finished
            keys.append(self.done_key(lock, identity))
            args.append(as_ms(done_ttl))
        return keys, args

    def idempotent_done(self, key: str) -> bool:
        return bool(self.client.exists(self.marker_key(key)))

    def holder_record(self, key: str) -> HolderRecord | None:
        fields = self.client.hmget(self.lock_key(key), ["token", "task_id", "host", "pid"])
        token, task_id, host, pid = (as_text(v) for v in fields)
        if token is None:
            return None
        return token, task_id, host, as_int(pid)

    def rate_take(self, key: str, token: str, rate: Rate, *, reserve: bool = True) -> RateTaken:
        reply = self._rate_take(
            keys=[self.rate_key(key), self.rate_starts_key(key)],
            args=[token, rate.limit, max(1, int(rate.period * 1_000_000)), int(reserve)],
        )
        return RateTaken(bool(int(reply[0])), int(reply[2]) / 1_000_000, int(reply[1]), float(as_text(reply[3]) or 0))

    def rate_release(self, key: str, token: str) -> bool:
        # A reservation's member is the bare token; an admitted call's is "<token>@<start>".
        return bool(self.client.zrem(self.rate_key(key), token))

    def rate_counts(self, pattern: str = "*", *, limit: int | None = None) -> list[RateCount]:
        """Found with SCAN (at most ``C.RATE_SCAN_KEYS`` keys looked at), one pipeline per key.

        The log does not store its period: it is read back from the key's expiry, which the script
        sets to its last entry plus the period (``rate_take.lua``)."""
        head = self.config.key_prefix + C.KEY_RATE.format(key="")
        cluster = self.config.redis_cluster
        match = glob_escape(head) + ("*" if cluster else pattern)
        found: list[RateCount] = []
        for looked, raw in enumerate(self.client.scan_iter(match=match, count=LOCK_SCAN_COUNT, _type="zset")):
            if looked >= C.RATE_SCAN_KEYS or (limit is not None and len(found) >= limit):
                break
            redis_key = as_text(raw) or ""
            key = self.user_key(redis_key, C.KEY_RATE)
            if cluster and not fnmatch.fnmatchcase(key, pattern):
                continue
            # TIME names no key (a cluster pipeline could not place it): read it apart, just before.
            now = self._server_now()
            pipe = self.client.pipeline(transaction=False)
            pipe.pttl(redis_key)
            pipe.zrange(redis_key, -1, -1, withscores=True)
            pttl, last = pipe.execute()
            if not last or pttl is None or pttl < 0:
                continue
            period = pttl / 1000.0 + now - float(last[0][1])
            starts_key = self.rate_starts_key(key)
            started = int(self.client.zcount(starts_key, f"({now - period:.6f}", f"{now:.6f}"))
            waiting = int(self.client.zcount(redis_key, f"({now:.6f}", "+inf"))
            if started or waiting:
                found.append(RateCount(key, started, waiting))
        found.sort(key=lambda c: c.key)
        return found

    def _server_now(self) -> float:
        seconds, micros = self.client.time()
        return float(seconds) + float(micros) / 1e6

    def describe(self) -> str:
        return f"Redis {mask_url(self.config.redis_url)}, safe_time_redis_url"

    # --- unique task keys (one key per script call: <prefix>unique:<key>) ------------------------
    def _unique_acquire(
        self, key: str, task: str, ttl: float, state: str, stored: bool | None, host: str, gone: str | None, own: bool
    ) -> UniqueClaim:
        flag = "" if stored is None else ("1" if stored else "0")
        args: list[str | int] = [task, as_ms(ttl), state, flag, host, gone or "", "1" if own else "0"]
        reply = self._unique_script(keys=[self.unique_key(key)], args=args)
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
        return bool(self._unique_release(keys=[self.unique_key(key)], args=[task_id]))

    def unique_info(self, key: str, now: float) -> LockInfo | None:
        redis_key = self.unique_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(redis_key, ["task_id", "host", "state", "created_at"])
        pipe.pttl(redis_key)
        fields, pttl = pipe.execute()
        if pttl == -2 or not any(fields):
            return None
        task_id, host, state, created_at = (as_text(v) for v in fields)
        age = round(now - float(created_at), 3) if created_at else None
        ttl_left = round(pttl / 1000.0, 3) if pttl >= 0 else None
        return LockInfo.unique(key, redis_key, task_id, host, age, ttl_left, state)

    def scan_unique(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        return self._scan_hashes(
            C.KEY_UNIQUE, pattern, limit, lambda raw, now: self.unique_info(self.user_key(raw, C.KEY_UNIQUE), now)
        )

    def force_release_unique(self, key: str) -> LockInfo | None:
        info = self.unique_info(key, self._server_now())
        if info is not None:
            self.client.delete(self.unique_key(key))
        return info

    # --- operator view ---------------------------------------------------------
    def info(self, redis_key: str, now: float) -> LockInfo | None:
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
            pid=as_int(pid),
            fence=as_int(fence),
            age=round(now - float(acquired), 3) if acquired else None,
            ttl_left=round(pttl / 1000.0, 3) if pttl >= 0 else None,
        )

    def scan(self, pattern: str = "*", *, limit: int | None = None) -> list[LockInfo]:
        """Found with SCAN, never KEYS."""
        return self._scan_hashes(C.KEY_LOCK, pattern, limit, self.info)

    def _scan_hashes(
        self, template: str, pattern: str, limit: int | None, info: Callable[[str, float], LockInfo | None]
    ) -> list[LockInfo]:
        """The hashes under ``template`` whose user key matches ``pattern``, read by ``info``, sorted."""
        now = self._server_now()
        found: list[LockInfo] = []
        # On a cluster the key part is braced (``lock:{k}``, ``lock:idem:{k}``, ``unique:{k}``): SCAN
        # every key there and match the pattern against the user's key (Redis glob and fnmatch agree
        # on * ? [...]).
        head = glob_escape(self.config.key_prefix) + template.format(key="")
        cluster = self.config.redis_cluster
        match = head + "*" if cluster else head + pattern
        for raw in self.client.scan_iter(match=match, count=LOCK_SCAN_COUNT, _type="hash"):
            redis_key = as_text(raw) or ""
            if cluster and not fnmatch.fnmatchcase(self.user_key(redis_key, template), pattern):
                continue
            held = info(redis_key, now)
            if held is not None:
                found.append(held)
                if limit is not None and len(found) >= limit:
                    break
        found.sort(key=lambda i: i.key)
        return found

    def force_release(self, key: str) -> LockInfo | None:
        info = self.info(self.lock_key(key), self._server_now())
        if info is not None:
            self.client.delete(self.lock_key(key))
        return info
