"""An in-process beat backend for unit tests: the Redis scripts' rules on dicts, time injected.

Several :class:`MemoryBeatBackend` objects built on one :class:`MemoryBeatData` behave like beats
sharing one Redis: one lease, one fired-slot guard, one schedule state. Expiry follows ``now``
(a callable, ``time.time`` by default). No runtime entries (their API is Redis's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ... import constants as C
from ...clock import ServerClock, Sync, measure_sync
from ...config import SafeTimeConfig
from ..shards import BeatPulse, shard_of
from ..state import slot_id
from .base import BeatBackend, BeatLease, DueRead, EntryCounts, LeaseView, Scored, Seed, SlotWrite, Snapshot


class MemoryUnavailable(Exception):
    """Raised when a test has switched the in-memory backend off (``MemoryBeatData.down``)."""


@dataclasses.dataclass
class MemoryBeatData:
    """What beats share: the lease, the epoch counter, fired slots (slot id -> expiry), states, due set."""

    now: Callable[[], float] = time.time
    token: str | None = None
    expires: float = 0.0
    epoch: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    fired: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    #: the marker a backfill claimed a fired slot with (a retried claim finds its own)
    claimed: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    states: dict[str, str] = dataclasses.field(default_factory=dict)
    due: dict[str, float] = dataclasses.field(default_factory=dict)
    #: run history: entry -> slot ms -> [published JSON, outcome JSON or None]
    history: dict[str, dict[int, list[Any]]] = dataclasses.field(default_factory=dict)
    #: change audit: entry -> records (JSON), oldest first
    audit: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: runtime definitions (name -> JSON) the readers see; a test puts them here (``entry_save``
    #: is not kept by this backend)
    definitions: dict[str, str] = dataclasses.field(default_factory=dict)
    #: set True to make every call raise :class:`MemoryUnavailable` (an outage)
    down: bool = False
    mutex: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    #: sharded firing: the other shards' data (lease, epoch, states, due set; the rest shared), by shard
    shards: dict[int, MemoryBeatData] = dataclasses.field(default_factory=dict)
    #: beat heartbeats (sharded firing): member -> its last pulse; shared by every shard
    beats: dict[str, BeatPulse] = dataclasses.field(default_factory=dict)

    def shard(self, shard: int) -> MemoryBeatData:
        """Shard ``shard``'s data (0: this one): its own lease and schedule state, the fired slots,
        run history, audit, definitions and heartbeats shared."""
        if shard == 0:
            return self
        with self.mutex:
            if shard not in self.shards:
                self.shards[shard] = dataclasses.replace(
                    self, token=None, expires=0.0, epoch=0, info={}, states={}, due={}, shards={}
                )
            return self.shards[shard]

    def check(self) -> None:
        if self.down:
            raise MemoryUnavailable("the in-memory beat backend is down")

    @contextlib.contextmanager
    def up(self) -> Iterator[MemoryBeatData]:
        """This data under its lock, once :meth:`check` passed."""
        with self.mutex:
            self.check()
            yield self

    def fire(self, key: tuple[str, str]) -> bool:
        """Mark a slot fired unless its marker is live; True when this call marked it."""
        now = self.now()
        if self.fired.get(key, now) > now:
            return False
        self.fired[key] = now + C.FIRED_SLOT_TTL
        return True

    def record(self, name: str, slot: float, record: str, size: int) -> None:
        """Keep a run record, the entry's oldest beyond ``size`` dropped (as the Redis scripts do)."""
        if size <= 0:
            return
        runs = self.history.setdefault(name, {})
        runs[int(slot_id(slot))] = [record, None]
        for old in sorted(runs)[: max(0, len(runs) - size)]:
            del runs[old]

    def held_by(self, token: str, epoch: int | None = None) -> bool:
        live = self.token is not None and self.expires > self.now()
        return live and self.token == token and (epoch is None or self.epoch == epoch)


class MemoryClock(ServerClock):
    unavailable: tuple[type[Exception], ...] = (MemoryUnavailable,)
    authority = "in-memory clock"

    def __init__(self, data: MemoryBeatData) -> None:
        super().__init__(refresh=0.0)
        self._data = data

    def measure(self) -> Sync:
        self._data.check()
        return measure_sync(self._data.now, samples=1, local=self._data.now)


class MemoryLease(BeatLease):
    def __init__(self, data: MemoryBeatData, config: SafeTimeConfig, info: dict[str, Any] | None = None) -> None:
        super().__init__(config, info)
        self.data = data

    def acquire(self, now: float) -> int | None:
        with self.data.up() as d:
            if d.held_by(self.token):
                d.expires = d.now() + self.config.beat_lease
                self.epoch = d.epoch
                return self.epoch
            if d.token is not None and d.expires > d.now():
                self.epoch = None
                return None
            d.epoch += 1
            d.token, d.expires = self.token, d.now() + self.config.beat_lease
            d.info = {**self.holder_info(now), "epoch": d.epoch}
            self.epoch = d.epoch
            return self.epoch

    def renew(self) -> bool:
        with self.data.up() as d:
            if self.epoch is None or not d.held_by(self.token, self.epoch):
                self.epoch = None
                return False
            d.expires = d.now() + self.config.beat_lease
            return True

    def release(self) -> bool:
        self.epoch = None
        with self.data.up() as d:
            if d.token != self.token:
                return False
            d.token, d.info = None, {}
            return True

    def write_slots(self, epoch: int, writes: list[SlotWrite]) -> list[int]:
        with self.data.up() as d:
            verdicts = []
            for write in writes:
                if not d.held_by(self.token, epoch):
                    verdicts.append(-1)
                    continue
                fresh = write.slot is None or d.fire((write.entry, slot_id(write.slot)))
                if write.slot is not None and fresh and write.history is not None:
                    d.record(write.entry, write.slot, write.history, self.config.beat_history_size)
                d.states[write.entry] = write.state
                d.due[write.entry] = write.next_fire
                verdicts.append(1 if fresh else 0)
            return verdicts

    def dispatch_slot(self, epoch: int, entry: str, slot: float) -> int:
        with self.data.up() as d:
            if not d.held_by(self.token, epoch):
                return -1
            return 1 if d.fire((entry, slot_id(slot))) else 0

    def forget(self, epoch: int, names: list[str], *, keep_state: bool) -> bool:
        with self.data.up() as d:
            if not d.held_by(self.token, epoch):
                return False
            for name in names:
                d.due.pop(name, None)
                if not keep_state:
                    d.states.pop(name, None)
            return True


class MemoryBeatBackend(BeatBackend):
    name = "memory"
    label = "memory"
    keeps_heartbeats = True
    errors: tuple[type[Exception], ...] = (MemoryUnavailable,)

    def __init__(self, config: SafeTimeConfig, data: MemoryBeatData | None = None) -> None:
        super().__init__(config)
        self.data = data if data is not None else MemoryBeatData()
        self.clock = MemoryClock(self.data)
        self.due_name = "due"
        self.state_name = "state"

    def for_shard(self, shard: int) -> MemoryBeatBackend:
        backend = MemoryBeatBackend(self.config, self.data.shard(shard))
        backend.shard = shard
        return backend

    def beats_heartbeat(self, member: str, pulse: BeatPulse, window: float) -> dict[str, BeatPulse]:
        with self.data.up() as d:
            d.beats[member] = pulse
            for gone in [m for m, seen in d.beats.items() if seen.seen < pulse.seen - window]:
                del d.beats[gone]
            return dict(d.beats)

    def beats_gone(self, member: str) -> None:
        with self.data.mutex:
            self.data.beats.pop(member, None)

    def beats_seen(self) -> dict[str, BeatPulse]:
        with self.data.up():
            return dict(self.data.beats)

    def _sorted_due(self) -> Scored:
        return sorted(self.data.due.items(), key=lambda item: (item[1], item[0]))

    def make_lease(self, *, info: dict[str, Any] | None = None) -> MemoryLease:
        return MemoryLease(self.data, self.config, info)

    def lease_view(self) -> LeaseView:
        with self.data.up() as d:
            held = d.token is not None and d.expires > d.now()
            return LeaseView(
                info=dict(d.info) if held else {},
                ttl_ms=round((d.expires - d.now()) * 1000) if held else None,
                epoch=d.epoch or None,
                now=d.now(),
            )

    def holds_lease(self, token: str) -> bool:
        with self.data.up():
            return self.data.held_by(token)

    def where(self) -> str:
        return "memory (this process)"

    def startup_checks(self, who: str) -> None:
        self.data.check()

    def read_due(self, now: float, limit: int) -> DueRead:
        with self.data.up() as d:
            ordered = self._sorted_due()
            return DueRead(
                due=[item for item in ordered if item[1] <= now][:limit],
                due_count=len(d.due),
                state_count=len(d.states),
                version=0,
                head=ordered[:1],
            )

    def head(self, limit: int = 1) -> Scored:
        with self.data.up():
            return self._sorted_due()[:limit]

    def drop_due(self, name: str) -> None:
        with self.data.up():
            self.data.due.pop(name, None)

    def snapshot(self) -> Snapshot:
        with self.data.up():
            return Snapshot(version=0, definitions=dict(self.data.definitions), requests={}, marker=None)

    def read_all(self) -> tuple[dict[str, Any], dict[str, float], int]:
        with self.data.up():
            return dict(self.data.states), dict(self.data.due), 0

    def read_states(self, names: list[str]) -> tuple[list[Any], list[float | None]]:
        with self.data.up():
            return [self.data.states.get(n) for n in names], [self.data.due.get(n) for n in names]

    def due_count(self) -> int:
        return len(self.data.due)

    def write_plan(
        self, token: str, states: dict[str, str], nexts: dict[str, float], gone: list[str], idle: list[str]
    ) -> bool:
        with self.data.up() as d:
            if not d.held_by(token):
                return False
            d.states.update(states)
            d.due.update(nexts)
            for name in gone:
                d.states.pop(name, None)
                d.due.pop(name, None)
            for name in idle:
                d.due.pop(name, None)
            return True

    def change_log(self, since: int | None = None, limit: int | None = None) -> Scored:
        return []

    def run_now_requests(self) -> dict[str, str]:
        return {}

    def read_changed(self, names: list[str]) -> tuple[list[Any], list[Any], list[float | None]]:
        states, scores = self.read_states(names)
        return [None] * len(names), states, scores

    def prune(self, version: int, names: list[str]) -> None:
        return None

    def mark_applied(self, token: str, marker: str) -> None:
        return None

    def run_now_done(self, name: str, slot_ms: str) -> None:
        return None

    def swap_definition(self, name: str, expected: Any, new: str, audit: str | None = None) -> int:
        return -1

    def entry_save(self, name: str, raw: str, audit: str | None = None, seed: Seed | None = None) -> int:
        raise MemoryUnavailable("runtime entries are not kept by the in-memory beat backend")

    def entry_delete(self, name: str, audit: str | None = None) -> int:
        raise MemoryUnavailable("runtime entries are not kept by the in-memory beat backend")

    def entry_run_now(self, name: str, slot_ms: str) -> int:
        raise MemoryUnavailable("runtime entries are not kept by the in-memory beat backend")

    def entry_definition(self, name: str) -> Any:
        with self.data.up():
            return self.data.definitions.get(name)

    def entry_definitions(self, prefix: str | None = None) -> dict[str, Any]:
        with self.data.up():
            return {k: v for k, v in self.data.definitions.items() if not prefix or k.startswith(prefix)}

    def _data_of(self, name: str) -> MemoryBeatData:
        """The data of the shard ``name`` belongs to (the API side reads and seeds any entry's state)."""
        return self.data.shard(shard_of(name, self.config.beat_shards)) if self.shard == 0 else self.data

    def entry_counts(self, soon: float) -> EntryCounts:
        with self.data.up():
            every = [self.data.shard(shard) for shard in range(self.config.beat_shards)] if self.shard == 0 else []
            dues = [score for data in every or [self.data] for score in data.due.values()]
            return EntryCounts(
                definitions=len(self.data.definitions),
                scheduled=len(dues),
                due_soon=sum(1 for score in dues if score <= soon),
            )

    def entry_rows(self, names: list[str]) -> tuple[list[Any], list[float | None], list[float | None]]:
        with self.data.up():
            found = [self._data_of(name) for name in names]
            states = [data.states.get(name) for data, name in zip(found, names, strict=True)]
            scores = [data.due.get(name) for data, name in zip(found, names, strict=True)]
        return states, scores, [None] * len(names)

    def entry_seed_state(self, name: str, state: str) -> None:
        self._data_of(name).states.setdefault(name, state)

    def slot_fired(self, name: str, slot: float) -> bool:
        return (name, slot_id(slot)) in self.data.fired

    def claim_slots(self, name: str, slots: list[float], marker: str) -> list[bool]:
        with self.data.up() as d:
            out = []
            for slot in slots:
                key = (name, slot_id(slot))
                fresh = d.fire(key)
                if fresh:
                    d.claimed[key] = marker
                out.append(fresh or d.claimed.get(key) == marker)
            return out

    def history_record(self, name: str, slot: float, record: str) -> None:
        with self.data.up():
            self.data.record(name, slot, record, self.config.beat_history_size)

    def history_outcome(self, name: str, slot: float, outcome: str) -> bool:
        with self.data.up():
            run = self.data.history.get(name, {}).get(int(slot_id(slot)))
            if run is None:
                return False
            run[1] = outcome
            return True

    def history(self, name: str, limit: int) -> list[tuple[Any, Any]]:
        with self.data.up():
            runs = self.data.history.get(name, {})
            return [(runs[s][0], runs[s][1]) for s in sorted(runs, reverse=True)[:limit]]

    def audit_append(self, name: str, record: str) -> None:
        size = self.config.beat_audit_size
        with self.data.up():
            if size > 0:
                records = self.data.audit.setdefault(name, [])
                records.append(record)
                del records[: max(0, len(records) - size)]

    def audit(self, name: str, limit: int) -> list[Any]:
        with self.data.up():
            return list(reversed(self.data.audit.get(name, [])))[:limit]

    def prune_fired(self, token: str) -> int:
        d = self.data
        with d.mutex:
            old = [key for key, expiry in d.fired.items() if expiry <= d.now()]
            for key in old:
                del d.fired[key]
            return len(old)
