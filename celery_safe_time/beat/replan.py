"""The leader's re-planning on taking the lease: :meth:`ReplanningScheduler.reconcile` loads the
runtime entries and re-plans what changed since the previous leader (or everything), and
:meth:`~ReplanningScheduler.reconcile_lazy` does it for a leader with many runtime entries, which
keeps none of them and reads only what is due. :class:`~.scheduler.SafeScheduler` is built on it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Generator
from typing import Any

import celery
from celery import Celery
from celery.beat import ScheduleEntry

from .. import constants as C
from ..exceptions import LeaseLost, ScheduleError
from ..redis_client import as_text
from .base import LeasedScheduler, collector_paused
from .definitions import build_entry, parse_definition, paused_until, spec_key
from .policies import OPTION_CATCHUP_WINDOW, OPTION_JITTER
from .shards import shard_of
from .slots import OPTION_MISFIRE, Plan, entry_plan, next_state
from .state import load_state

logger = logging.getLogger(__name__)

#: What a reconcile writes: (state JSON by name, next slot by name, gone, idle, tombstones to prune).
Replan = tuple[dict[str, str], dict[str, float], list[str], list[str], list[str]]


def _plan_key(definition: dict[str, Any]) -> tuple[Any, ...]:
    """A parsed runtime definition's key in the plan cache: its schedule, task and policies (the
    entries that share them share one validated plan)."""
    options = definition["options"]
    return (
        spec_key(definition["schedule"]),
        definition["task"],
        options.get(OPTION_MISFIRE),
        options.get(OPTION_JITTER),
        options.get(OPTION_CATCHUP_WINDOW),
    )


class ReplanningScheduler(LeasedScheduler):
    """The re-planning half of :class:`~.scheduler.SafeScheduler`, with the loading of one runtime
    entry (:meth:`load_runtime`). The scheduler sets these attributes (its ``__init__`` documents
    them; ``app`` and ``schedule`` are celery's) and publishes the run-now requests (``run_requested``)."""

    app: Celery
    schedule: dict[str, ScheduleEntry]
    plans: dict[str, Plan]
    broken: dict[str, str]
    config_names: set[str]
    runtime: dict[str, bytes]
    paused: dict[str, ScheduleEntry]
    pause_expiry: dict[str, float]
    seen_version: int
    lazy: bool
    lazy_threshold: int
    _schedules: dict[Any, Any]
    _runtime_plans: dict[Any, Plan]
    #: a plan of every entry still going on (:meth:`replan_step` runs its next chunk between ticks)
    _replanning: Generator[None, None, tuple[int, int]] | None = None
    #: the epoch of the leader term that plan belongs to, for its closing log line
    _replanning_epoch: int = 0

    shard: int
    shards: int

    def owns(self, name: str) -> bool:
        """Whether this scheduler's shard leads the entry ``name`` (the config entries: shard 0)."""
        if self.shards <= 1:
            return True
        if name in self.config_names:
            return self.shard == 0
        return shard_of(name, self.shards) == self.shard

    def run_requested(self, epoch: int, requests: dict[str, str]) -> bool:
        raise NotImplementedError

    def _broken(self, name: str, reason: str) -> None:
        self.broken[name] = reason
        logger.error("beat: entry %r is disabled: %s (the other entries keep firing)", name, reason)

    def _drop(self, name: str) -> None:
        self.schedule.pop(name, None)
        self.plans.pop(name, None)
        self.paused.pop(name, None)
        self.pause_expiry.pop(name, None)
        self.broken.pop(name, None)

    def load_runtime(self, name: str, raw: Any) -> str:
        """Take one runtime definition (None: deleted) into the schedule; returns what it became:
        "active", "paused", "removed", "broken" or "conflict" (named like a beat_schedule entry)."""
        if name in self.config_names:
            if raw is not None:
                logger.error(
                    "beat: runtime entry %r is ignored: the config entry %r (beat_schedule) has that name",
                    name,
                    name,
                )
            return "conflict"
        if not self.owns(name):
            return "elsewhere"  # another shard's (its leader loads it)
        self._drop(name)
        if raw is None:
            self.runtime.pop(name, None)
            return "removed"
        self.runtime[name] = raw
        try:
            definition = parse_definition(raw)
            entry = build_entry(name, definition, self.app, self._schedules)
            key = _plan_key(definition)
            plan = self._runtime_plans.get(key)
            if plan is None:
                plan = self._runtime_plans[key] = entry_plan(entry, self.config, self.app)
        except Exception as exc:
            self._broken(name, f"invalid runtime entry: {exc}")
            return "broken"
        if not definition["enabled"]:
            self.paused[name] = entry
            until = paused_until(definition)
            if until is not None:
                self.pause_expiry[name] = until
            return "paused"
        self.schedule[name] = entry
        self.plans[name] = plan
        return "active"

    def fingerprint(self) -> str:
        """What an entry's state depends on besides its definition (a plain crontab's grid follows the
        app timezone): a leader with another fingerprint re-plans every entry."""
        return f"format={C.BEAT_ENTRY_FORMAT};celery={celery.__version__};tz={self.app.timezone}"

    def _mark_applied(self) -> None:
        """Record that the state and due set reflect every change up to ``seen_version`` (leader only);
        not while a plan of every entry is under way (they do not, until it ends)."""
        if self._replanning is not None:
            return
        self.backend.mark_applied(self.lease.token, f"{self.seen_version} {self.fingerprint()}")

    def _applied_since(self, marker: Any, version: int) -> int | None:
        """The version a previous leader's state reflects, None when it cannot be trusted (no marker,
        another fingerprint, or a counter that went backwards: the backend was reset)."""
        if not marker:
            return None
        applied, _, fingerprint = as_text(marker).partition(" ")
        try:
            since = int(applied)
        except ValueError:
            return None
        return since if fingerprint == self.fingerprint() and 0 <= since <= version else None

    def reconcile(self, epoch: int, now: float, *, full: bool = False) -> None:
        """On taking the lease: load every runtime entry and re-plan (with ``lazy_threshold`` runtime
        entries or more: :meth:`reconcile_lazy`, which ``full`` makes plan every entry).

        With the previous leader's marker (the version its state reflects), only the config entries and
        the runtime entries changed since are re-planned; without one, or when the due-set count does not
        add up afterwards, every entry is, from a full read of the state.
        """
        self.changes_behind = False  # a new term reads the whole state: no batch of the log is pending
        if self.backend.reads_due_only and self.backend.definition_count() >= self.lazy_threshold:
            self.reconcile_lazy(epoch, now, full=full)
            return
        self.lazy = False
        snapshot = self.backend.snapshot()
        version, requests, marker = snapshot.version, snapshot.requests, snapshot.marker
        definitions = snapshot.definitions
        del snapshot  # the definitions are freed with the local below
        # Loading 100,000 entries makes a million objects that all live on: without this, the cyclic
        # collector would walk the growing heap again and again while they are built.
        with collector_paused():
            for name in list(self.runtime):
                self._drop(name)
            self.runtime = {}
            for key, raw in definitions.items():
                self.load_runtime(key, raw)
            del definitions
            since = self._applied_since(marker, version)
            plan = None if since is None else self._replan_changed(now, since)
            mode = f"changes after version {since}"
            if plan is None:
                plan = self._replan_all(now)
                mode = "full"
        if len(self.schedule) + len(self.paused) >= C.BEAT_GC_FREEZE_ENTRIES:
            # The entries live for the whole term and hold no reference cycles (a replaced one is freed
            # by its reference count): keep the collector's full passes from walking them in a tick.
            gc.freeze()
        states, nexts, gone, idle, tombstones = plan
        # Only the lease holder may rewrite the schedule (paused and broken runtime entries keep their
        # state: a resume or a fix continues the grid).
        if not self.backend.write_plan(self.lease.token, states, nexts, gone, idle):
            raise LeaseLost("another beat holds the lease: the plan write was refused")
        tombstones = [n for n in tombstones if self.owns(n)]  # another shard's are its leader's to apply
        if tombstones:  # deletions this leader has applied; a name saved again since is kept
            self.backend.prune(version, tombstones)
        # the pauses to expire, for a next leader that reads only what is due
        self.backend.set_pause_expiries(dict(self.pause_expiry), [], replace=True)
        self.seen_version = version
        self._mark_applied()
        # run-now requests made while no beat led: their counter bump is already behind us
        self.run_requested(epoch, requests)
        logger.info(
            "beat: leader with epoch %s: %d entries (%d runtime, %d paused; re-planned %s: %d new or edited, "
            "%d removed, %d disabled)",
            epoch,
            len(self.plans),
            len(self.runtime),
            len(self.paused),
            mode,
            len(states),
            len(gone),
            len(self.broken),
        )

    # --- reading only what is due (many runtime entries) ----------------------------------------
    def _load(self, names: list[str]) -> None:
        """Build the runtime entries ``names`` from their definitions (one read per chunk); a name
        without one (deleted: the change log tells the rest) is left out."""
        for i in range(0, len(names), C.BEAT_LAZY_CHUNK):
            chunk = names[i : i + C.BEAT_LAZY_CHUNK]
            for name, raw in zip(chunk, self.backend.definitions(chunk), strict=True):
                if raw is not None:
                    self.load_runtime(name, raw)

    def _evict(self, force: bool = False) -> None:
        """Forget the built runtime entries once there are more than ``BEAT_LAZY_CACHE`` (``force``:
        whatever their number); their pause expiries stay (this leader resumes them)."""
        if not force and len(self.runtime) <= C.BEAT_LAZY_CACHE:
            return
        for name in self.runtime:
            self.schedule.pop(name, None)
            self.plans.pop(name, None)
            self.paused.pop(name, None)
            self.broken.pop(name, None)
        self.runtime = {}
        if len(self._schedules) > C.BEAT_LAZY_CACHE or len(self._runtime_plans) > C.BEAT_LAZY_CACHE:
            self._schedules, self._runtime_plans = {}, {}

    def reconcile_lazy(self, epoch: int, now: float, *, full: bool = False) -> None:
        """:meth:`reconcile` for a leader with many runtime entries: nothing is loaded for good.

        With the previous leader's marker, only the config entries and the runtime entries changed
        since are read and re-planned; without one (or with ``full``: the due set lost entries), every
        definition is planned a chunk per tick (:meth:`replan_step`) and forgotten, so memory stays flat
        and the leader fires what is due in between.
        """
        meta = self.backend.snapshot_meta()
        version, requests, marker = meta.version, meta.requests, meta.marker
        self._replanning = None  # a plan left by an earlier term is void: this one starts over
        self._evict(force=True)
        self.lazy = True
        self.pause_expiry = {}
        since = None if full else self._applied_since(marker, version)
        if since is None:
            # A plan of every entry takes a while at a million (seconds of CPU): it goes a chunk per
            # tick instead, so this leader fires what is due meanwhile. Every entry is planned from
            # ``now``, the lease's start, however late its chunk: a slot that falls due while its
            # chunk waits is due when it is planned, and fires late but once. Until the plan ends
            # the marker is cleared: a leader taking over half way plans everything again.
            self.backend.mark_applied(self.lease.token, "")  # refused, as the writes are, unless leading
            self.seen_version = version
            self._replanning = self._replan_streaming(now, version)
            self._replanning_epoch = epoch
            self.run_requested(epoch, requests)
            logger.info(
                "beat: leader with epoch %s reading only due entries: %d config entries, %d runtime; "
                "planning every entry from %s, a chunk per tick",
                epoch,
                len(self.config_names),
                self.backend.definition_count(),
                now,
            )
            self.replan_step()  # the config entries first (a fresh leader: nothing else is due yet)
            return
        changed = [name for name, _ in self.backend.change_log(since)]
        self._load(changed)
        plan = self._replan_changed(now, since)
        assert plan is not None  # a leader reading only what is due does not count the due set
        states, nexts, gone, idle, tombstones = plan
        if not self.backend.write_plan(self.lease.token, states, nexts, gone, idle):
            raise LeaseLost("another beat holds the lease: the plan write was refused")
        tombstones = [n for n in tombstones if self.owns(n)]
        if tombstones:
            self.backend.prune(version, tombstones)
        expiries = {n: t for n, t in self.backend.pause_expiries().items() if n not in set(changed)}
        mine = {n: self.pause_expiry[n] for n in changed if n in self.pause_expiry}
        self.backend.set_pause_expiries(mine, [n for n in changed if n not in mine])
        self.pause_expiry = {**expiries, **mine}
        self.seen_version = version
        self._mark_applied()
        self.run_requested(epoch, requests)
        self._evict()
        logger.info(
            "beat: leader with epoch %s reading only due entries: %d config entries, %d runtime; re-planned "
            "changes after version %s: %d new or edited, %d removed",
            epoch,
            len(self.config_names),
            self.backend.definition_count(),
            since,
            len(states),
            len(gone),
        )

    @property
    def replanning(self) -> bool:
        """True while a plan of every entry is under way (a fresh leader, or a new fingerprint)."""
        return self._replanning is not None

    def replan_step(self) -> bool:
        """Plan the next chunk of a plan of every entry, if one is under way; True while more remain.
        The tick calls it before reading what is due. When the plan ends, the marker records it."""
        steps = self._replanning
        if steps is None:
            return False
        try:
            with collector_paused():  # each chunk's objects are freed by their reference counts
                next(steps)
            return True
        except StopIteration as done:
            self._replanning = None
            planned, removed = done.value
        except BaseException:
            self._replanning = None  # a lost lease or a backend error ends the term: the next plans again
            raise
        self._mark_applied()
        logger.info(
            "beat: leader with epoch %s planned every entry: %d new or edited, %d removed",
            self._replanning_epoch,
            planned,
            removed,
        )
        return False

    def _replan_streaming(self, now: float, version: int) -> Generator[None, None, tuple[int, int]]:
        """Re-plan every entry without holding them all, a step per chunk (:meth:`replan_step`): drop
        the states and due scores left by entries that no longer exist, then plan the config entries,
        then each chunk of runtime definitions (planned from ``now``, written, forgotten). Returns
        (entries planned, entries removed).

        Between two steps the leader ticks: it fires what the due set holds (the previous plan's
        scores, and the chunks planned so far) and applies changes; each chunk reads the state as it
        is then, so an entry fired or changed meanwhile keeps its state (the same signature and score
        make no new plan), and a slot recorded as fired is never planned again."""
        token = self.lease.token
        firsts: dict[str, float] = {}
        # the config entries first, in the step the takeover runs: the tick counts them in the due set
        config = {name: None for name in self.config_names if name in self.plans}
        planned = self._plan_chunk(token, config, now, firsts, stored=True)
        yield
        # then what the state holds for entries that no longer exist (before this plan adds runtime
        # entries to it: a fresh leader finds nothing to read there)
        removed = 0
        stored = False  # whether the state and the due set hold runtime entries (else nothing to read)
        for names in self.backend.scan_planned(C.BEAT_LAZY_CHUNK):
            candidates = [n for n in names if n not in self.plans]
            stored = stored or bool(candidates)
            if not candidates:
                continue
            defs_of = self.backend.definitions(candidates)
            gone = [n for n, raw in zip(candidates, defs_of, strict=True) if raw is None]
            if gone:
                if not self.backend.write_plan(token, {}, {}, gone, []):
                    raise LeaseLost("another beat holds the lease: the plan write was refused")
                removed += len(gone)
            yield
        for defs in self.backend.scan_definitions(C.BEAT_LAZY_CHUNK):
            # A tick between two steps may write a planned entry's state (it fired, or changed): each
            # chunk after the first reads the state, so that one keeps it (a name may come twice).
            planned += self._plan_chunk(token, defs, now, firsts, stored=stored)
            stored = True
            self._evict(force=True)
            yield
        self.backend.set_pause_expiries(dict(self.pause_expiry), [], replace=True)
        self._prune_tombstones(version)
        return planned, removed

    def _plan_chunk(
        self, token: str, defs: dict[str, Any], now: float, firsts: dict[str, float], *, stored: bool
    ) -> int:
        """Plan one chunk of :meth:`_replan_streaming` (name -> runtime definition, None for a config
        entry) from ``now`` and write it; ``stored``: read the chunk's state first (else there is
        none). Returns how many entries got a new plan."""
        # a runtime entry named like a config one is ignored
        # another shard's runtime entries are its leader's to plan
        names = [n for n, raw in defs.items() if raw is None or (n not in self.config_names and self.owns(n))]
        plans = [self.plans.get(n) if defs[n] is None else self._stream_plan(n, defs[n]) for n in names]
        raws, scores = self.backend.read_states(names) if stored else ([None] * len(names), [None] * len(names))
        states: dict[str, str] = {}
        nexts: dict[str, float] = {}
        idle: list[str] = []
        for name, plan, raw, score in zip(names, plans, raws, scores, strict=True):
            if plan is not None:
                made = next_state(plan, load_state(raw), score, now, firsts, name=name)
                if made is not None:
                    states[name], nexts[name] = made
            elif defs[name] is not None and score is not None:
                idle.append(name)  # paused or broken: out of the due set, state kept
        if not self.backend.write_plan(token, states, nexts, [], idle):
            raise LeaseLost("another beat holds the lease: the plan write was refused")
        return len(states)

    def _stream_plan(self, name: str, raw: Any) -> Plan | None:
        """The plan of one runtime definition for :meth:`_replan_streaming`, which keeps no entry: the
        plan made for an earlier entry of the same schedule, task and policies when there is one (no
        entry built), else through :meth:`load_runtime`. None when it is paused or broken."""
        try:
            definition = parse_definition(raw)
            plan = self._runtime_plans.get(_plan_key(definition)) if definition["enabled"] else None
        except (ScheduleError, TypeError):
            plan = None
        if plan is not None:
            return plan
        became = self.load_runtime(name, raw)
        return self.plans.get(name) if became == "active" else None

    def _prune_tombstones(self, version: int) -> None:
        """Drop the change log's tombstones (names without a definition), a page at a time; only when
        the log holds more names than there are definitions (else it holds none)."""
        if self.backend.change_count() <= self.backend.definition_count():
            return
        since: int | None = None
        while True:
            page = self.backend.change_log(since, C.BEAT_LAZY_CHUNK)
            if not page:
                return
            names = [name for name, _ in page]
            dead = [
                n for n, raw in zip(names, self.backend.definitions(names), strict=True) if raw is None and self.owns(n)
            ]
            self.backend.prune(version, dead)
            if len(page) < C.BEAT_LAZY_CHUNK:
                return
            since = int(page[-1][1])

    def _replan_all(self, now: float) -> Replan:
        """(states, nexts, gone, idle, tombstones) from a full read of the state hash and the due set."""
        stored, scores, logged = self.backend.read_all()
        states: dict[str, str] = {}
        nexts: dict[str, float] = {}
        firsts: dict[str, float] = {}  # first slot by grid signature: many entries share a schedule
        for name, plan in self.plans.items():
            planned = next_state(plan, load_state(stored.get(name)), scores.get(name), now, firsts, name=name)
            if planned is not None:
                states[name], nexts[name] = planned
        scheduled = set(scores)
        gone = sorted((scheduled | set(stored)) - set(self.plans) - set(self.runtime))
        idle = sorted(scheduled & (set(self.runtime) - set(self.plans)))
        tombstones: list[str] = []
        if int(logged) > len(self.runtime):  # the log holds deletions: read it (else it is one per entry)
            log = self.backend.change_log()
            tombstones = [name for name, _ in log if name not in self.runtime]
        return states, nexts, gone, idle, tombstones

    def _replan_changed(self, now: float, since: int) -> Replan | None:
        """Like :meth:`_replan_all` for the config entries and the runtime entries changed after
        ``since`` only; None when the due set would not then hold exactly the planned entries (state
        lost or written by hand, a config entry removed from beat_schedule): re-plan everything."""
        changed = [name for name, _ in self.backend.change_log(since)]
        changed_runtime = set(changed) & set(self.runtime)
        recheck = sorted(self.config_names | set(changed) | set(self.broken))
        raws, scores = self.backend.read_states(recheck)
        due_count = self.backend.due_count()
        states: dict[str, str] = {}
        nexts: dict[str, float] = {}
        gone: list[str] = []
        idle: list[str] = []
        firsts: dict[str, float] = {}
        for name, raw, score in zip(recheck, raws, scores, strict=True):
            plan = self.plans.get(name)
            if plan is not None:
                # a runtime entry changed with its state kept and out of the due set was resumed
                resumed = name in changed_runtime
                planned = next_state(plan, load_state(raw), score, now, firsts, name=name, resumed=resumed)
                if planned is not None:
                    states[name], nexts[name] = planned
                    due_count += score is None
            elif name in self.runtime:
                if score is not None:
                    idle.append(name)
                    due_count -= 1
            elif raw is not None or score is not None:
                gone.append(name)
                due_count -= score is not None
        if not self.lazy and due_count != len(self.plans):
            logger.info(
                "beat: the due set would hold %d entries for %d planned; re-planning every entry",
                due_count,
                len(self.plans),
            )
            return None
        tombstones = [name for name in changed if name not in self.runtime]
        return states, nexts, gone, idle, tombstones
