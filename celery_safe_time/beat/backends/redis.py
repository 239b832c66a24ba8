"""The Redis beat backend (the default): the leader lease, the guarded dispatch and the runtime
entries as Lua scripts (``beat/lua/*.lua``), and the keys they use.

- acquire: ``SET lease token NX PX`` and ``INCR epoch`` in one script, so every lease has a
  new epoch and the leader info (host, pid, epoch) is written with it.
- renew: compare-and-pexpire; release: compare-and-delete. A beat never touches a lease it
  does not hold.
- dispatch: before a slot is published, check token and epoch and ``SET NX`` the slot marker,
  and record the entry's new state, all in one round trip. ``dispatch_slot`` is the same check
  for a scheduler whose state lives elsewhere; ``advance`` moves an entry on without publishing.

Every caller takes its scripts from :func:`beat_scripts`, one registry: each source is read once
per process and registered once per client (Redis loads it on the first ``EVALSHA`` that answers
NOSCRIPT). Lua that several scripts share lives in a ``lua/_*.lua`` file of local functions, which
:func:`script_source` puts before each script listed in :data:`PRELUDES`.

Keys under ``safe_time_key_prefix`` (:class:`BeatKeys`): ``beat:lease``, ``beat:epoch``,
``beat:leader``, ``beat:state`` (hash), ``beat:due`` (sorted set), ``beat:fired:<entry>:<slot ms>``
(markers with a TTL) and the runtime entries' ``beat:entries*``.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import threading
import weakref
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

import redis

from ... import constants as C
from ...clock import RedisClock
from ...config import SafeTimeConfig, mask_url
from ...exceptions import ImproperlyConfigured, RedisUnavailable
from ...health import check_redis
from ...redis_client import as_text, get_redis, glob_escape, load_script, tls_hint
from ..shards import BeatPulse, shard_of
from ..state import load_state, marker_value, slot_id
from .base import BeatBackend, BeatLease, DueRead, EntryCounts, LeaseView, Scored, Seed, ShardView, SlotWrite, Snapshot
from .redis_keys import BeatKeys

__all__ = [
    "PRELUDES",
    "REDIS_ERRORS",
    "SCRIPTS",
    "BeatKeys",
    "Lease",
    "RedisBeatBackend",
    "beat_scripts",
    "history_keys",
    "script_source",
]

logger = logging.getLogger(__name__)

#: What Redis raises when it fails; the beat then stands by (fail closed).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisUnavailable)


# --- scripts ------------------------------------------------------------------------------------

#: The package whose ``lua/`` folder holds the beat scripts.
LUA_PACKAGE = "celery_safe_time.beat"

#: Change log members the name index takes in per script call (and definitions per HSCAN when it is
#: built from the hash): about 10 ms of Redis each.
NAMES_SYNC_CHUNK = 10_000

#: Every beat script, by file name. The lease and the tick use the first seven; the runtime entries
#: and backfills (called by any process, not only by beats) the others.
SCRIPTS = (
    "acquire",
    "renew",
    "release",
    "dispatch",
    "dispatch_slot",
    "advance",
    "forget",
    "save_entry",
    "save_entries",
    "delete_entry",
    "run_now",
    "run_now_done",
    "prune",
    "swap_entry",
    "mark_applied",
    "claim_slots",
    "history_record",
    "history_outcome",
    "sync_names",
    "drop_names",
)


#: The shared files (``lua/<name>.lua``, no script on their own) that go before a script's source.
PRELUDES: dict[str, tuple[str, ...]] = {
    "dispatch": ("_history",),
    "history_record": ("_history",),
}


@functools.cache
def script_source(name: str) -> str:
    """The Lua source of the beat script ``name`` as Redis runs it: its preludes, then its own file."""
    return "".join(load_script(LUA_PACKAGE, part) for part in (*PRELUDES.get(name, ()), name))


_registered: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def beat_scripts(client: Any) -> dict[str, Any]:
    """The beat scripts of ``client`` (a ``redis.Redis`` or ``RedisCluster``) by name, registered on
    first use: ``scripts["dispatch"](keys=..., args=...)``."""
    with _lock:
        scripts = _registered.get(client)
        if scripts is None:
            scripts = _registered[client] = {name: client.register_script(script_source(name)) for name in SCRIPTS}
        return scripts


# --- keys and the lease --------------------------------------------------------------------------


def history_keys(config: SafeTimeConfig, entry: str) -> list[str]:
    """The run history keys of ``entry``: its records (hash) and its slots in order (zset)."""
    return [config.key(C.KEY_BEAT_HISTORY, entry=entry), config.key(C.KEY_BEAT_HISTORY_SLOTS, entry=entry)]


class Lease(BeatLease):
    def __init__(
        self, client: redis.Redis, config: SafeTimeConfig, *, info: dict[str, Any] | None = None, shard: int = 0
    ) -> None:
        super().__init__(config, info)
        self.client = client
        self.keys = BeatKeys.for_config(config, shard)
        self.ttl_ms = int(config.beat_lease * 1000)
        self.scripts = beat_scripts(client)

    def acquire(self, now: float) -> int | None:
        info = json.dumps(self.holder_info(now))
        keys = [self.keys.lease, self.keys.epoch, self.keys.info]
        result = int(self.scripts["acquire"](keys=keys, args=[self.token, self.ttl_ms, info]))
        self.epoch = result if result > 0 else None
        return self.epoch

    def renew(self) -> bool:
        if self.epoch is None:
            return False
        keys = [self.keys.lease, self.keys.epoch, self.keys.info]
        ok = bool(self.scripts["renew"](keys=keys, args=[self.token, self.ttl_ms, self.epoch]))
        if not ok:
            self.epoch = None
        return ok

    def release(self) -> bool:
        self.epoch = None
        return bool(self.scripts["release"](keys=[self.keys.lease, self.keys.info], args=[self.token]))

    def dispatch_slot(self, epoch: int, entry: str, slot: float) -> int:
        marker = self.config.key(C.KEY_BEAT_FIRED, entry=entry, slot=slot_id(slot))
        keys = [self.keys.lease, self.keys.epoch, marker]
        args = [self.token, epoch, C.FIRED_SLOT_TTL * 1000, marker_value(epoch)]
        return int(self.scripts["dispatch_slot"](keys=keys, args=args))

    def write_slots(self, epoch: int, writes: list[SlotWrite]) -> list[int]:
        """The scripts are not atomic together: if the lease expires half way, the writes after it
        answer -1 and those before stand, as they would one by one."""
        calls = [self._write_call(epoch, write, marker_value(epoch)) for write in writes]
        return [int(reply) for reply in self._pipelined(calls)]

    def forget(self, epoch: int, names: list[str], *, keep_state: bool) -> bool:
        """In one round trip; nothing after a refusal is changed."""
        if not names:
            return True
        keys = [self.keys.lease, self.keys.epoch, self.keys.state, self.keys.due]
        keep = "1" if keep_state else "0"
        calls = [(self.scripts["forget"], keys, [self.token, epoch, name, keep]) for name in names]
        return all(int(reply) >= 0 for reply in self._pipelined(calls))

    def _pipelined(self, calls: list[tuple[Any, list[str], list[Any]]]) -> Iterator[Any]:
        """Run (script, keys, args) calls in one pipeline; their replies in order, each read as it is
        asked for (a caller that stops early leaves the rest unchecked)."""
        pipe = self.client.pipeline(transaction=False)
        for script, keys, args in calls:
            # evalsha without SCRIPT EXISTS first: a script Redis lost is loaded on NOSCRIPT below.
            # Sent as a raw command: redis-py's cluster pipeline refuses its evalsha() method, but
            # routes a raw EVALSHA by its keys (all beat keys share one slot there).
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        for (script, keys, args), reply in zip(calls, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = script(keys=keys, args=args)  # registers and retries this one
            elif isinstance(reply, Exception):
                raise reply
            yield reply

    def _write_call(self, epoch: int, write: SlotWrite, marker: str) -> tuple[Any, list[str], list[Any]]:
        if write.slot is None:
            return (
                self.scripts["advance"],
                [self.keys.lease, self.keys.epoch, self.keys.state, self.keys.due],
                [self.token, epoch, write.entry, write.state, repr(write.next_fire)],
            )
        key = self.config.key(C.KEY_BEAT_FIRED, entry=write.entry, slot=slot_id(write.slot))
        keys = [self.keys.lease, self.keys.epoch, key, self.keys.state, self.keys.due]
        args = [self.token, epoch, C.FIRED_SLOT_TTL * 1000, write.entry, write.state, repr(write.next_fire), marker]
        if write.history is not None and self.config.beat_history_size > 0:
            # the run record rides in the dispatch script: no round trip of its own
            keys += history_keys(self.config, write.entry)
            args += [write.history, self.config.beat_history_size, slot_id(write.slot)]
        return self.scripts["dispatch"], keys, args


# --- the backend ----------------------------------------------------------------------------------


def scored(reply: Any) -> list[tuple[str, float]]:
    """A ``withscores`` reply as (member, score) pairs."""
    return [(as_text(member), float(score)) for member, score in reply]


class RedisBeatBackend(BeatBackend):
    name = C.COORDINATION_REDIS
    label = "Redis"
    errors = REDIS_ERRORS
    keeps_heartbeats = True

    def __init__(self, config: SafeTimeConfig, client: redis.Redis | None = None, shard: int = 0) -> None:
        super().__init__(config)
        self.client = client if client is not None else get_redis(config.redis_url)
        self.clock = RedisClock(self.client)
        self.shard = shard
        self.keys = BeatKeys.for_config(config, shard)
        self.due_name = self.keys.due
        self.state_name = self.keys.state
        self.scripts = beat_scripts(self.client)

    # --- shards -----------------------------------------------------------------------
    def for_shard(self, shard: int) -> RedisBeatBackend:
        backend = RedisBeatBackend(self.config, self.client, shard)
        backend.clock = self.clock
        return backend

    def beats_heartbeat(self, member: str, pulse: BeatPulse, window: float) -> dict[str, BeatPulse]:
        key = self.config.key(C.KEY_BEAT_BEATS)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, member, pulse.dump())
        # gone with the last beat: each heartbeat pushes the expiry past the window it counts in
        pipe.pexpire(key, max(1, int(window * 2 * 1000)))
        pipe.hgetall(key)
        found = pipe.execute()[2]
        stored = self._pulses((as_text(m), as_text(v)) for m, v in found.items())
        live = {member: seen for member, seen in stored.items() if seen.seen >= pulse.seen - window}
        if len(live) < len(found):
            self.client.hdel(key, *[m for m in found if as_text(m) not in live])
        return live

    def beats_gone(self, member: str) -> None:
        self.client.hdel(self.config.key(C.KEY_BEAT_BEATS), member)

    def shard_view(self) -> ShardView:
        lease = self.lease_view()
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(self.keys.due)
        pipe.zcount(self.keys.due, "-inf", lease.now)
        pipe.zrange(self.keys.due, 0, 0, withscores=True)
        scheduled, due_now, head = pipe.execute()
        return ShardView(lease, int(scheduled), int(due_now), float(head[0][1]) if head else None)

    def beats_seen(self) -> dict[str, BeatPulse]:
        found = self.client.hgetall(self.config.key(C.KEY_BEAT_BEATS))
        return self._pulses((as_text(m), as_text(v)) for m, v in found.items())

    def _keys_of(self, name: str) -> BeatKeys:
        """The keys of the shard ``name`` belongs to (the API side reads any entry's state)."""
        shard = shard_of(name, self.config.beat_shards)
        return self.keys if shard == self.shard else BeatKeys.for_config(self.config, shard)

    # --- the lease ------------------------------------------------------------------
    def make_lease(self, *, info: dict[str, Any] | None = None) -> Lease:
        return Lease(self.client, self.config, info=info, shard=self.shard)

    def lease_view(self) -> LeaseView:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.info)
        pipe.pttl(self.keys.lease)
        pipe.get(self.keys.epoch)
        info, ttl_ms, epoch = pipe.execute()
        # not in the pipeline: a cluster pipeline routes by key, and TIME has none
        seconds, micros = self.client.time()
        return LeaseView(
            info=load_state(info),
            ttl_ms=int(ttl_ms) if ttl_ms is not None and int(ttl_ms) > 0 else None,
            epoch=int(epoch) if epoch else None,
            now=float(seconds) + float(micros) / 1e6,
        )

    def holds_lease(self, token: str) -> bool:
        return bool(self.client.get(self.keys.lease) == token.encode())

    # --- connection ---------------------------------------------------------------
    def where(self) -> str:
        return f"redis {mask_url(self.config.redis_url)}"

    def startup_checks(self, who: str) -> None:
        config = self.config
        try:
            offset = self.clock.sync()
        except RedisUnavailable as exc:
            hint = tls_hint(config.redis_url, exc)
            if hint is not None:
                raise ImproperlyConfigured("safe_time_redis_url", f"{who}: {hint}") from exc
            raise RedisUnavailable(
                f"{who}: Redis {mask_url(config.redis_url)} is unreachable at startup: {exc}"
            ) from exc
        if abs(offset.offset) > config.max_clock_skew:
            logger.warning(
                "%s: this host's clock is %+.3f s off Redis TIME; beat uses Redis TIME, so it still fires on time",
                who,
                offset.offset,
            )
        for check in check_redis(config, self.client):
            if check.status != "ok" and check.name in (
                "redis_persistence",
                "redis_eviction",
                "redis_replication",
                "redis_config",
            ):
                logger.warning("%s: %s: %s", who, check.name, check.detail)

    # --- ticks --------------------------------------------------------------------
    def read_due(self, now: float, limit: int) -> DueRead:
        # One range up to now + BEAT_HEAD_WINDOW gives the due entries (a prefix: the range is in score
        # order) and the head, without a ZRANGE of its own: an idle tick is mostly the client's work
        # on its commands, so each command saved shortens it.
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(self.keys.due, "-inf", now + C.BEAT_HEAD_WINDOW, start=0, num=limit, withscores=True)
        pipe.zcard(self.keys.due)
        pipe.hlen(self.keys.state)
        pipe.get(self.keys.version)
        reply, due_count, state_count, version = pipe.execute()
        ahead = scored(reply)
        due = ahead[: bisect.bisect_right(ahead, now, key=itemgetter(1))]
        return DueRead(due, int(due_count), int(state_count), int(version or 0), ahead[:1])

    def head(self, limit: int = 1) -> Scored:
        return scored(self.client.zrange(self.keys.due, 0, limit - 1, withscores=True))

    def drop_due(self, name: str) -> None:
        self.client.zrem(self.keys.due, name)

    # --- re-planning --------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return self._snapshot(definitions=True)

    def _snapshot(self, *, definitions: bool) -> Snapshot:
        # one snapshot: the counter matches the definitions and the marker the state
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.version)
        if definitions:
            pipe.hgetall(self.keys.entries)
        pipe.hgetall(self.keys.run_now)
        pipe.get(self.keys.applied)
        version_raw, *found, requests, marker = pipe.execute()
        return Snapshot(
            version=int(version_raw or 0),
            definitions={as_text(k): v for raw in found for k, v in raw.items()},
            requests={as_text(k): as_text(v) for k, v in requests.items()},
            marker=as_text(marker) if marker else None,
        )

    # --- reading what is due --------------------------------------------------------
    reads_due_only = True

    def definition_count(self) -> int:
        return int(self.client.hlen(self.keys.entries))

    def change_count(self) -> int:
        return int(self.client.zcard(self.keys.changed))

    def definitions(self, names: list[str]) -> list[Any]:
        return list(self.client.hmget(self.keys.entries, names)) if names else []

    def _scan(self, scan: Any, key: str, count: int) -> Iterator[Any]:
        """The non-empty pages of ``scan`` (``client.hscan``, ``client.zscan``) over ``key``, to the end."""
        cursor = 0
        while True:
            cursor, found = scan(key, cursor, count=count)
            if found:
                yield found
            if int(cursor) == 0:
                return

    def scan_definitions(self, chunk: int) -> Iterator[dict[str, Any]]:
        for found in self._scan(self.client.hscan, self.keys.entries, chunk):
            yield {as_text(k): v for k, v in found.items()}

    def scan_planned(self, chunk: int) -> Iterator[list[str]]:
        for fields in self._scan(self.client.hscan, self.keys.state, chunk):  # the state hash's names
            yield [as_text(k) for k in fields]
        for members in self._scan(self.client.zscan, self.keys.due, chunk):  # then the due set's
            yield [as_text(member) for member, _ in members]

    def snapshot_meta(self) -> Snapshot:
        return self._snapshot(definitions=False)

    def pause_expiries(self) -> dict[str, float]:
        return dict(scored(self.client.zrange(self.keys.pause_expiry, 0, -1, withscores=True)))

    def set_pause_expiries(self, add: dict[str, float], remove: list[str], *, replace: bool = False) -> None:
        pipe = self.client.pipeline(transaction=True)
        if replace:
            pipe.delete(self.keys.pause_expiry)
        if remove:
            pipe.zrem(self.keys.pause_expiry, *remove)
        if add:
            pipe.zadd(self.keys.pause_expiry, add)
        if len(pipe):
            pipe.execute()

    def read_all(self) -> tuple[dict[str, Any], dict[str, float], int]:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.state)
        pipe.zrange(self.keys.due, 0, -1, withscores=True)
        pipe.zcard(self.keys.changed)
        stored_raw, due, logged = pipe.execute()
        return {as_text(k): v for k, v in stored_raw.items()}, dict(scored(due)), int(logged)

    def read_states(self, names: list[str]) -> tuple[list[Any], list[float | None]]:
        if not names:
            return [], []
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.state, names)
        pipe.zmscore(self.keys.due, names)
        raws, scores = pipe.execute()
        return list(raws), list(scores)

    def due_count(self) -> int:
        return int(self.client.zcard(self.keys.due))

    def write_plan(
        self, token: str, states: dict[str, str], nexts: dict[str, float], gone: list[str], idle: list[str]
    ) -> bool:
        pipe = self.client.pipeline(transaction=False)
        # a few big commands rather than two per entry: 100,000 new entries are one HSET and one ZADD
        names = list(states)
        for i in range(0, len(names), C.BEAT_CHANGES_BATCH * 5):
            chunk = names[i : i + C.BEAT_CHANGES_BATCH * 5]
            pipe.hset(self.keys.state, mapping={n: states[n] for n in chunk})
            pipe.zadd(self.keys.due, {n: nexts[n] for n in chunk})
        # paused and broken runtime entries keep their state (a resume or a fix continues the grid)
        if gone:
            pipe.zrem(self.keys.due, *gone)
            pipe.hdel(self.keys.state, *gone)
        if idle:
            pipe.zrem(self.keys.due, *idle)
        # Only the lease holder may rewrite the schedule: check before sending the batch.
        if not self.holds_lease(token):
            return False
        pipe.execute()
        return True

    # --- runtime entries ----------------------------------------------------------
    def change_log(self, since: int | None = None, limit: int | None = None) -> Scored:
        low = "-inf" if since is None else f"({since}"
        start = None if limit is None else 0  # redis-py takes both or neither
        return scored(self.client.zrangebyscore(self.keys.changed, low, "+inf", start, limit, withscores=True))

    def run_now_requests(self) -> dict[str, str]:
        return {as_text(k): as_text(v) for k, v in self.client.hgetall(self.keys.run_now).items()}

    def read_changed(self, names: list[str]) -> tuple[list[Any], list[Any], list[float | None]]:
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.entries, names)
        pipe.hmget(self.keys.state, names)
        pipe.zmscore(self.keys.due, names)
        raws, states, scores = pipe.execute()
        return list(raws), list(states), list(scores)

    def prune(self, version: int, names: list[str]) -> None:
        if names:
            self.scripts["prune"](keys=[self.keys.entries, self.keys.changed], args=[version, *names])

    def mark_applied(self, token: str, marker: str) -> None:
        self.scripts["mark_applied"](keys=[self.keys.lease, self.keys.applied], args=[token, marker])

    def run_now_done(self, name: str, slot_ms: str) -> None:
        self.scripts["run_now_done"](keys=[self.keys.run_now], args=[name, slot_ms])

    def swap_definition(self, name: str, expected: Any, new: str, audit: str | None = None) -> int:
        keys, args = self._entry_keys(), [name, expected, new]
        if audit is not None and self.config.beat_audit_size > 0:  # lua/swap_entry.lua appends it with the change
            keys.append(self.config.key(C.KEY_BEAT_AUDIT, entry=name))
            args += [audit, self.config.beat_audit_size]
        return int(self.scripts["swap_entry"](keys=keys, args=args))

    # --- runtime entries: the API side -------------------------------------------------
    def _entry_keys(self) -> list[str]:
        return [self.keys.entries, self.keys.version, self.keys.changed]

    def _kept_keys(self, name: str) -> list[str]:
        """The entry's audit and history keys, which a save and a delete touch."""
        return [self.config.key(C.KEY_BEAT_AUDIT, entry=name), *history_keys(self.config, name)]

    def _audit_args(self, audit: str | None) -> list[str]:
        size = self.config.beat_audit_size
        return [audit if audit is not None and size > 0 else "", str(size)]

    def entry_save(self, name: str, raw: str, audit: str | None = None, seed: Seed | None = None) -> int:
        keys = [*self._entry_keys(), *self._kept_keys(name)]
        args = [name, raw, *self._audit_args(audit)]
        if seed is not None:
            shard = self._keys_of(name)
            keys += (shard.state, shard.due)
            args += (seed[0], repr(seed[1]))
        return int(self.scripts["save_entry"](keys=keys, args=args))

    def entry_save_many(
        self, items: list[tuple[str, str]], audit: str | None = None, seeds: list[Seed | None] | None = None
    ) -> list[int]:
        if not items:
            return []
        # one script call for the chunk (lua/save_entries.lua: save_entry.lua's steps, entry by entry)
        audit_key = self.config.key_maker(C.KEY_BEAT_AUDIT)
        history_key = self.config.key_maker(C.KEY_BEAT_HISTORY)
        slots_key = self.config.key_maker(C.KEY_BEAT_HISTORY_SLOTS)
        shards = self.config.beat_shards
        keys = self._entry_keys()
        args: list[str | int] = [*self._audit_args(audit), len(items)]
        # entries planned alike share a seed (the same tuple): each distinct one is sent once
        table: dict[Seed, str] = {}
        for (name, raw), seed in zip(items, seeds if seeds is not None else [None] * len(items), strict=True):
            keys += (audit_key(entry=name), history_key(entry=name), slots_key(entry=name))
            ref = "" if seed is None else table.get(seed) or table.setdefault(seed, str(len(table)))
            if ref and shards > 1:
                ref = f"{ref}:{shard_of(name, shards)}"
            args += (name, raw, ref)
        for state, due in table:
            args += (state, repr(due))
        for shard in range(shards):
            shard_keys = BeatKeys.for_config(self.config, shard)
            keys += (shard_keys.state, shard_keys.due)
        return [int(v) for v in self.scripts["save_entries"](keys=keys, args=args)]

    def entry_delete(self, name: str, audit: str | None = None) -> int:
        keys = [*self._entry_keys(), *self._kept_keys(name)]
        keep_ms = str(int(C.BEAT_DELETED_HISTORY_KEEP * 1000))
        return int(self.scripts["delete_entry"](keys=keys, args=[name, *self._audit_args(audit), keep_ms]))

    # --- run history and change audit ---------------------------------------------------
    def history_record(self, name: str, slot: float, record: str) -> None:
        if self.config.beat_history_size > 0:
            self.scripts["history_record"](
                keys=history_keys(self.config, name), args=[slot_id(slot), record, self.config.beat_history_size]
            )

    def history_outcome(self, name: str, slot: float, outcome: str) -> bool:
        key = self.config.key(C.KEY_BEAT_HISTORY, entry=name)
        return bool(self.scripts["history_outcome"](keys=[key], args=[slot_id(slot), outcome]))

    def history(self, name: str, limit: int) -> list[tuple[Any, Any]]:
        records, slots = history_keys(self.config, name)
        ids = [as_text(s) for s in self.client.zrevrange(slots, 0, max(limit, 1) - 1)]
        if not ids:
            return []
        values = self.client.hmget(records, [field for s in ids for field in (s, s + ":o")])
        return [(values[2 * i], values[2 * i + 1]) for i in range(len(ids)) if values[2 * i] is not None]

    def audit_append(self, name: str, record: str) -> None:
        """Append ``record``; a ``delete`` record (a django-celery-beat row deleted: ``entry_delete``
        does its own) sets the entry's runs and changes to expire ``BEAT_DELETED_HISTORY_KEEP`` later,
        as PostgreSQL's prune deletes them, and any other record keeps them again (a name re-created)."""
        size = self.config.beat_audit_size
        if size <= 0:
            return
        key = self.config.key(C.KEY_BEAT_AUDIT, entry=name)
        pipe = self.client.pipeline(transaction=True)
        pipe.lpush(key, record)
        pipe.ltrim(key, 0, size - 1)
        deleted = _action_of(record) == "delete"
        for kept in self._kept_keys(name):
            if deleted:
                pipe.pexpire(kept, int(C.BEAT_DELETED_HISTORY_KEEP * 1000))
            else:
                pipe.persist(kept)
        pipe.execute()

    def audit(self, name: str, limit: int) -> list[Any]:
        return list(self.client.lrange(self.config.key(C.KEY_BEAT_AUDIT, entry=name), 0, max(limit, 1) - 1))

    def entry_definition(self, name: str) -> Any:
        return self.client.hget(self.keys.entries, name)

    def entry_definitions(self, prefix: str | None = None) -> dict[str, Any]:
        match = None if not prefix else glob_escape(prefix) + "*"
        return {as_text(k): v for k, v in self.client.hscan_iter(self.keys.entries, match=match, count=1000)}

    # --- operator views ---------------------------------------------------------------
    def _sync_names(self) -> None:
        """Bring the name index up to the change log (lua/sync_names.lua), a chunk per call; when it
        still holds fewer names than the definitions (written around the scripts), add every
        definition's name once."""
        keys = [self.keys.entries, self.keys.changed, self.keys.names, self.keys.names_version, self.keys.version]
        while True:
            _applied, more, indexed, stored = self.scripts["sync_names"](keys=keys, args=[NAMES_SYNC_CHUNK])
            if not int(more):
                break
        if int(indexed) >= int(stored):
            return
        logger.info("beat: the name index holds %s of %s runtime entries; adding every name", indexed, stored)
        for fields in self._scan(self.client.hscan, self.keys.entries, NAMES_SYNC_CHUNK):
            self.client.zadd(self.keys.names, dict.fromkeys((as_text(field) for field in fields), 0))

    def entry_page(self, after: str | None, limit: int, prefix: str | None = None) -> list[tuple[str, Any]]:
        if limit <= 0:
            return []
        self._sync_names()
        # ZRANGEBYLEX compares bytes: UTF-8's byte order is the code points' order, and no UTF-8
        # name holds the byte 0xff, so prefix + 0xff is past every name starting with prefix.
        low, high = b"-", b"+"
        if prefix:
            low, high = b"[" + prefix.encode(), b"(" + prefix.encode() + b"\xff"
        if after is not None and (not prefix or after >= prefix):
            low = b"(" + after.encode()
        out: list[tuple[str, Any]] = []
        while len(out) < limit:
            want = limit - len(out)
            names = self.client.zrangebylex(self.keys.names, low, high, start=0, num=want)
            if not names:
                break
            raws = self.client.hmget(self.keys.entries, names)
            gone = [name for name, raw in zip(names, raws, strict=True) if raw is None]
            out += [(as_text(name), raw) for name, raw in zip(names, raws, strict=True) if raw is not None]
            if gone:
                self.scripts["drop_names"](keys=[self.keys.entries, self.keys.names], args=gone)
            if len(names) < want:
                break
            last = names[-1]
            low = b"(" + (last if isinstance(last, bytes) else str(last).encode())
        return out

    def entry_counts(self, soon: float) -> EntryCounts:
        pipe = self.client.pipeline(transaction=False)
        pipe.hlen(self.keys.entries)
        for shard in range(self.config.beat_shards):  # each shard's due set
            due = BeatKeys.for_config(self.config, shard).due
            pipe.zcard(due)
            pipe.zcount(due, "-inf", soon)
        definitions, *counts = pipe.execute()
        scheduled, due_soon = sum(int(c) for c in counts[::2]), sum(int(c) for c in counts[1::2])
        return EntryCounts(definitions=int(definitions), scheduled=scheduled, due_soon=due_soon)

    def entry_rows(self, names: list[str]) -> tuple[list[Any], list[float | None], list[float | None]]:
        if not names:
            return [], [], []
        pipe = self.client.pipeline(transaction=False)
        if self.config.beat_shards > 1:  # each name's state and score in its shard's keys
            for name in names:
                keys = self._keys_of(name)
                pipe.hget(keys.state, name)
                pipe.zscore(keys.due, name)
            pipe.zmscore(self.keys.changed, names)
            *pairs, versions = pipe.execute()
            return list(pairs[::2]), list(pairs[1::2]), list(versions)
        pipe.hmget(self.keys.state, names)
        pipe.zmscore(self.keys.due, names)
        pipe.zmscore(self.keys.changed, names)
        states, scores, versions = pipe.execute()
        return list(states), list(scores), list(versions)

    def entry_run_now(self, name: str, slot_ms: str) -> int:
        return int(self.scripts["run_now"](keys=[self.keys.run_now, self.keys.version], args=[name, slot_ms]))

    def entry_seed_state(self, name: str, state: str) -> None:
        self.client.hsetnx(self._keys_of(name).state, name, state)

    def slot_fired(self, name: str, slot: float) -> bool:
        return bool(self.client.exists(self.config.key(C.KEY_BEAT_FIRED, entry=name, slot=slot_id(slot))))

    def claim_slots(self, name: str, slots: list[float], marker: str) -> list[bool]:
        if not slots:
            return []
        keys = [self.config.key(C.KEY_BEAT_FIRED, entry=name, slot=slot_id(slot)) for slot in slots]
        reply = self.scripts["claim_slots"](keys=keys, args=[int(C.FIRED_SLOT_TTL * 1000), marker])
        return [int(v) == 1 for v in reply]


def _action_of(record: str) -> str | None:
    """The ``action`` of an audit record (JSON), None when it has none."""
    try:
        action = json.loads(record).get("action")
    except (ValueError, AttributeError):
        return None
    return action if isinstance(action, str) else None
