"""The beat leader lease and the guarded dispatch, as Redis Lua scripts.

- acquire: ``SET lease token NX PX`` and ``INCR epoch`` in one script, so every lease has a
  new epoch and the leader info (host, pid, epoch) is written with it.
- renew: compare-and-pexpire; release: compare-and-delete. A beat never touches a lease it
  does not hold.
- guard: before a slot is published, check token and epoch and ``SET NX`` the slot marker,
  and record the entry's new state, all in one round trip.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import uuid
from typing import Any

import redis

from . import constants as C
from .config import SafeTimeConfig

logger = logging.getLogger(__name__)

# KEYS: lease, epoch, leader info. ARGV: token, lease ms, info json (epoch filled in here).
ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local epoch = redis.call('INCR', KEYS[2])
local info = cjson.decode(ARGV[3])
info['epoch'] = epoch
redis.call('SET', KEYS[3], cjson.encode(info), 'PX', ARGV[2])
return epoch
"""

# KEYS: lease, epoch, leader info. ARGV: token, lease ms, epoch.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
"""

# KEYS: lease, leader info. ARGV: token.
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

# KEYS: lease, epoch, fired marker, state hash, due zset.
# ARGV: token, epoch, marker ttl ms, entry name, state json, next fire score, marker value.
# Returns 1 (publish), 0 (slot already fired: do not publish), -1 (not the leader).
GUARD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
local fresh = redis.call('SET', KEYS[3], ARGV[7], 'NX', 'PX', ARGV[3])
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[4])
if fresh then return 1 end
return 0
"""

# KEYS: lease, epoch, fired marker. ARGV: token, epoch, marker ttl ms, marker value.
# The guard without Redis-side state, for schedulers that keep state elsewhere (the database).
GUARD_SLOT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
if redis.call('SET', KEYS[3], ARGV[4], 'NX', 'PX', ARGV[3]) then return 1 end
return 0
"""

# KEYS: lease, epoch, state hash, due zset. ARGV: token, epoch, entry name, state json, next score.
# Moves an entry on without publishing (a skipped misfire, a new or edited entry); leader only.
ADVANCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[3])
return 1
"""


@dataclasses.dataclass(frozen=True)
class SlotWrite:
    """One entry's state change in a tick: guard ``slot`` (publish it) or, with no slot, advance."""

    entry: str
    state: str
    next_fire: float
    slot: float | None = None


@dataclasses.dataclass(frozen=True)
class LeaseKeys:
    lease: str
    epoch: str
    info: str
    state: str
    due: str

    @classmethod
    def for_config(cls, config: SafeTimeConfig) -> LeaseKeys:
        return cls(
            lease=config.key(C.KEY_BEAT_LEASE),
            epoch=config.key(C.KEY_BEAT_EPOCH),
            info=config.key(C.KEY_BEAT_LEADER_INFO),
            state=config.key(C.KEY_BEAT_STATE),
            due=config.key(C.KEY_BEAT_DUE),
        )


def identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


class Lease:
    """One beat's handle on the leader lease. Not thread-safe by itself: the scheduler's
    lease thread is its only caller, except :meth:`guard` which only reads the token."""

    def __init__(self, client: redis.Redis, config: SafeTimeConfig, *, info: dict[str, Any] | None = None) -> None:
        self.client = client
        self.config = config
        self.keys = LeaseKeys.for_config(config)
        self.token = uuid.uuid4().hex
        self.ttl_ms = int(config.beat_lease * 1000)
        self.info = dict(info or identity())
        self.epoch: int | None = None
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)
        self._guard = client.register_script(GUARD)
        self._advance = client.register_script(ADVANCE)
        self._guard_slot = client.register_script(GUARD_SLOT)

    def acquire(self, now: float) -> int | None:
        """Take (or keep) the lease; return the epoch, or None while another beat holds it."""
        info = json.dumps({**self.info, "token": self.token[:8], "since": now, "lease": self.config.beat_lease})
        result = int(
            self._acquire(keys=[self.keys.lease, self.keys.epoch, self.keys.info], args=[self.token, self.ttl_ms, info])
        )
        self.epoch = result if result > 0 else None
        return self.epoch

    def renew(self) -> bool:
        if self.epoch is None:
            return False
        ok = bool(
            self._renew(
                keys=[self.keys.lease, self.keys.epoch, self.keys.info], args=[self.token, self.ttl_ms, self.epoch]
            )
        )
        if not ok:
            self.epoch = None
        return ok

    def release(self) -> bool:
        self.epoch = None
        return bool(self._release(keys=[self.keys.lease, self.keys.info], args=[self.token]))

    def guard(self, epoch: int, entry: str, slot: float, state: str, next_fire: float) -> int:
        """Check the lease and mark ``entry``'s ``slot`` fired, recording its new state.

        1: publish it; 0: already fired by someone (do not publish); -1: not the leader.
        """
        script, keys, args = self._write_call(epoch, SlotWrite(entry, state, next_fire, slot))
        return int(script(keys=keys, args=args))

    def guard_slot(self, epoch: int, entry: str, slot: float) -> int:
        """Like :meth:`guard` for a scheduler whose state lives elsewhere: 1, 0 or -1."""
        marker = self.config.key(C.KEY_BEAT_FIRED, entry=entry, slot=slot_id(slot))
        return int(
            self._guard_slot(
                keys=[self.keys.lease, self.keys.epoch, marker],
                args=[self.token, epoch, C.FIRED_SLOT_TTL * 1000, str(epoch)],
            )
        )

    def write_slots(self, epoch: int, writes: list[SlotWrite]) -> list[int]:
        """Run a tick's guards and advances in one round trip; per write 1, 0 or -1 as :meth:`guard`
        (an advance gives 1 or -1).

        The scripts are not atomic together: if the lease expires half way, the writes after it
        answer -1 and those before stand, as they would one by one.
        """
        pipe = self.client.pipeline(transaction=False)
        scripts = []
        for write in writes:
            script, keys, args = self._write_call(epoch, write)
            scripts.append((script, keys, args))
            # evalsha without SCRIPT EXISTS first: a script Redis lost is loaded on NOSCRIPT below.
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        verdicts = []
        for (script, keys, args), reply in zip(scripts, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = script(keys=keys, args=args)  # registers and retries this one
            elif isinstance(reply, Exception):
                raise reply
            verdicts.append(int(reply))
        return verdicts

    def _write_call(self, epoch: int, write: SlotWrite) -> tuple[Any, list[str], list[Any]]:
        if write.slot is None:
            return (
                self._advance,
                [self.keys.lease, self.keys.epoch, self.keys.state, self.keys.due],
                [self.token, epoch, write.entry, write.state, repr(write.next_fire)],
            )
        marker = self.config.key(C.KEY_BEAT_FIRED, entry=write.entry, slot=slot_id(write.slot))
        return (
            self._guard,
            [self.keys.lease, self.keys.epoch, marker, self.keys.state, self.keys.due],
            [self.token, epoch, C.FIRED_SLOT_TTL * 1000, write.entry, write.state, repr(write.next_fire), str(epoch)],
        )

    def advance(self, epoch: int, entry: str, state: str, next_fire: float) -> bool:
        """Record ``entry``'s state without publishing; False when not the leader."""
        script, keys, args = self._write_call(epoch, SlotWrite(entry, state, next_fire))
        return int(script(keys=keys, args=args)) == 1


def slot_id(slot: float) -> str:
    """A slot's marker id: the UTC instant in whole milliseconds (stable across processes)."""
    return str(round(slot * 1000))
