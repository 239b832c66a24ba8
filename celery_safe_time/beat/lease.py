"""The beat leader lease and the guarded dispatch, as Redis Lua scripts (``beat/lua/*.lua``).

- acquire: ``SET lease token NX PX`` and ``INCR epoch`` in one script, so every lease has a
  new epoch and the leader info (host, pid, epoch) is written with it.
- renew: compare-and-pexpire; release: compare-and-delete. A beat never touches a lease it
  does not hold.
- dispatch: before a slot is published, check token and epoch and ``SET NX`` the slot marker,
  and record the entry's new state, all in one round trip. ``dispatch_slot`` is the same check
  for a scheduler whose state lives elsewhere; ``advance`` moves an entry on without publishing.

The entry state the scripts write is a JSON object per entry in the ``beat:state`` hash
(:func:`.state.dump_state`) plus its next fire time in the ``beat:due`` sorted set. The scripts
come from the registry of :mod:`.scripts`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import redis

from .. import constants as C
from ..config import SafeTimeConfig
from .backends.base import BeatLease, SlotWrite
from .scripts import beat_scripts
from .state import identity, marker_value, slot_id

__all__ = ["Lease", "LeaseKeys", "SlotWrite", "history_keys"]


def history_keys(config: SafeTimeConfig, entry: str) -> list[str]:
    """The run history keys of ``entry``: its records (hash) and its slots in order (zset)."""
    return [config.key(C.KEY_BEAT_HISTORY, entry=entry), config.key(C.KEY_BEAT_HISTORY_SLOTS, entry=entry)]


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


class Lease(BeatLease):
    """One beat's handle on the leader lease. Not thread-safe by itself: the scheduler's
    lease thread is its only caller, except the dispatch methods, which only read the token."""

    def __init__(self, client: redis.Redis, config: SafeTimeConfig, *, info: dict[str, Any] | None = None) -> None:
        self.client = client
        self.config = config
        self.keys = LeaseKeys.for_config(config)
        self.token = uuid.uuid4().hex
        self.ttl_ms = int(config.beat_lease * 1000)
        self.info = dict(info or identity())
        self.epoch: int | None = None
        scripts = beat_scripts(client)
        self._acquire = scripts["acquire"]
        self._renew = scripts["renew"]
        self._release = scripts["release"]
        self._dispatch = scripts["dispatch"]
        self._advance = scripts["advance"]
        self._dispatch_slot = scripts["dispatch_slot"]
        self._forget = scripts["forget"]

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

    def dispatch(self, epoch: int, entry: str, slot: float, state: str, next_fire: float) -> int:
        """Check the lease and mark ``entry``'s ``slot`` fired, recording its new state.

        1: publish it; 0: already fired by someone (do not publish); -1: not the leader.
        """
        script, keys, args = self._write_call(epoch, SlotWrite(entry, state, next_fire, slot), marker_value(epoch))
        return int(script(keys=keys, args=args))

    def dispatch_slot(self, epoch: int, entry: str, slot: float) -> int:
        """Like :meth:`dispatch` for a scheduler whose state lives elsewhere: 1, 0 or -1."""
        marker = self.config.key(C.KEY_BEAT_FIRED, entry=entry, slot=slot_id(slot))
        return int(
            self._dispatch_slot(
                keys=[self.keys.lease, self.keys.epoch, marker],
                args=[self.token, epoch, C.FIRED_SLOT_TTL * 1000, marker_value(epoch)],
            )
        )

    def write_slots(self, epoch: int, writes: list[SlotWrite]) -> list[int]:
        """Run a tick's dispatches and advances in one round trip; per write 1, 0 or -1 as :meth:`dispatch`
        (an advance gives 1 or -1).

        The scripts are not atomic together: if the lease expires half way, the writes after it
        answer -1 and those before stand, as they would one by one.
        """
        pipe = self.client.pipeline(transaction=False)
        scripts = []
        for write in writes:
            script, keys, args = self._write_call(epoch, write, marker_value(epoch))
            scripts.append((script, keys, args))
            # evalsha without SCRIPT EXISTS first: a script Redis lost is loaded on NOSCRIPT below.
            # Sent as a raw command: redis-py's cluster pipeline refuses its evalsha() method, but
            # routes a raw EVALSHA by its keys (all beat keys share one slot there).
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        replies = pipe.execute(raise_on_error=False)
        verdicts = []
        for (script, keys, args), reply in zip(scripts, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = script(keys=keys, args=args)  # registers and retries this one
            elif isinstance(reply, Exception):
                raise reply
            verdicts.append(int(reply))
        return verdicts

    def forget(self, epoch: int, names: list[str], *, keep_state: bool) -> bool:
        """Take ``names`` out of the due set (and, unless ``keep_state``, the state hash) in one round
        trip; False when this beat is not the leader (nothing after the refusal is changed)."""
        if not names:
            return True
        keys = [self.keys.lease, self.keys.epoch, self.keys.state, self.keys.due]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", self._forget.sha, len(keys), *keys, self.token, epoch, name, "1" if keep_state else "0"
            )
        replies = pipe.execute(raise_on_error=False)
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = self._forget(keys=keys, args=[self.token, epoch, name, "1" if keep_state else "0"])
            elif isinstance(reply, Exception):
                raise reply
            if int(reply) < 0:
                return False
        return True

    def _write_call(self, epoch: int, write: SlotWrite, marker: str) -> tuple[Any, list[str], list[Any]]:
        if write.slot is None:
            return (
                self._advance,
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
        return self._dispatch, keys, args
