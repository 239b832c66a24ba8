"""``SafeScheduler``: Celery beat with a leader lease, guarded dispatch and shared state, on the app's
beat backend (:mod:`.backends`: Redis by default, PostgreSQL with ``safe_time_coordination_url``).

Run it on every server (``celery beat -S celery_safe_time.SafeScheduler``, or embedded with ``worker -B``):
one beat leads, the others stand by. Per-entry state (last fired slot, next slot) lives in the backend,
indexed by next fire time, so a tick reads only the due entries and a new leader resumes where the old one stopped.

Entries come from ``beat_schedule`` and from runtime definitions (:mod:`.entries`): the leader loads them all
once per lease term, then only the changed ones. With ``BEAT_LAZY_ENTRIES`` runtime entries or more on a
backend that can (Redis), it keeps none of them and reads the definitions of the entries that fall due or
change (``reconcile_lazy``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry, Scheduler

from .. import constants as C
from .. import signals
from ..clock import to_datetime
from ..config import get_config
from ..exceptions import LeaseLost, ScheduleError
from ..messages.publishing import PublishBatch, batched_publish, publishes_in_batches
from . import history
from .backends.base import SlotWrite
from .base import collector_paused
from .definitions import parse_definition, paused_until
from .entries import with_enabled
from .leader import LeaseTerm
from .overlap import OverlapGate, slot_options
from .policies import beat_slots_past_catchup, config_spec
from .replan import ReplanningScheduler
from .shards import ShardGate
from .slots import NEVER, Plan, at, entry_plan, next_state
from .state import dump_state, load_state, state_next

logger = logging.getLogger(__name__)

__all__ = ["SafeScheduler"]


class SafeScheduler(ReplanningScheduler, Scheduler):
    """A beat that fires only while it holds the lease (Redis or PostgreSQL), each slot at most once."""

    Entry = ScheduleEntry

    #: ``safe_time_beat_shards`` above 1 is supported: the runtime entries are split into shards
    shardable = True

    def __init__(
        self, app: Celery, *args: Any, parent: SafeScheduler | None = None, shard: int = 0, **kwargs: Any
    ) -> None:
        config = get_config(app)
        #: this scheduler's shard of the runtime entries, and how many there are (``safe_time_beat_shards``)
        self.shard = shard
        self.shards = config.beat_shards
        #: shard 0's scheduler (None on shard 0 itself, which is celery's): it ticks the others
        self.parent = parent
        #: this beat's schedulers of shards 1 to K - 1 (on shard 0's; empty on theirs)
        self.shard_children: list[SafeScheduler] = []
        if parent is not None:
            self.gate: ShardGate | None = parent.gate
            self.init_lease(app, parent.backend.for_shard(shard), self.gate)
        else:
            self.init_lease(app)
            self.gate = None
            # one leader too, where the backend keeps heartbeats: its K is seen by the sharded beats
            # (and theirs by it), so that a beat left at one shard beside them does not fire as well
            if self.shards > 1 or self.backend.keeps_heartbeats:
                backend = self.backend
                self.gate = ShardGate(self.shards, config.beat_lease, backend.beats_heartbeat, backend.clock.time)
                self.keeper.join(self.gate)
        #: the entries' overlap policies, decided at dispatch (:mod:`.overlap`)
        self.overlap_gate = OverlapGate(app, self.config)
        self.plans: dict[str, Plan] = {}
        self.broken: dict[str, str] = {}
        self._reconciled: LeaseTerm | None = None
        #: names of the beat_schedule entries (a runtime entry never replaces one of them)
        self.config_names: set[str] = set()
        #: runtime entries this leader loaded: name -> their definition JSON (paused and broken too)
        self.runtime: dict[str, bytes] = {}
        #: paused runtime entries (not in the due set; their state is kept)
        self.paused: dict[str, ScheduleEntry] = {}
        #: paused runtime entries with an expiry: name -> when this leader resumes them (UNIX seconds)
        self.pause_expiry: dict[str, float] = {}
        #: the change counter of the runtime entries this leader has applied
        self.seen_version = -1
        #: True while the change log holds more changes than this leader's last tick applied
        self.changes_behind = False
        #: the leader's clock when it last pruned fired-slot records (``_housekeeping``)
        self._pruned_at = float("-inf")
        #: schedule objects of runtime entries by their spec (shared: they are never mutated)
        self._schedules: dict[Any, Any] = {}
        #: plans of runtime entries by (spec, task, misfire policy, jitter, catch-up window): validated
        #: once per distinct schedule
        self._runtime_plans: dict[Any, Plan] = {}
        #: task ids chosen with the run history records of the slots being published (history.py)
        self._task_ids: dict[tuple[str, float], str] = {}
        #: True while this leader reads definitions only for the entries that fall due or change (it
        #: holds at least ``lazy_threshold`` runtime entries): ``runtime`` is then a cache, not all
        self.lazy = False
        #: how many runtime entries make a leader read only what is due (decided at each takeover)
        self.lazy_threshold = C.BEAT_LAZY_ENTRIES
        #: sharded beats: when (``clock``) this shard's next tick is due, and the lease it was set under
        self._next_tick: float | None = None
        self._ticked_term: LeaseTerm | None = None
        super().__init__(app, *args, **kwargs)

    # --- setup --------------------------------------------------------------------
    def setup_schedule(self) -> None:
        if self.parent is not None:  # another shard of this beat: runtime entries only
            self.config_names = set(self.parent.config_names)  # a runtime entry with such a name is ignored
            self.start_lease()
            return
        self.check_startup(self.granularity)
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)
        self.config_names = set(self.schedule)
        if self.gate is not None:  # the beats' heartbeats carry it (set here: it reads the app)
            self.gate.fingerprint = self.fingerprint()
        self.shard_children = [
            SafeScheduler(self.app, parent=self, shard=shard, max_interval=self.max_interval)
            for shard in range(1, self.shards)
        ]
        self.start_lease()

    def close(self) -> None:
        for child in self.shard_children:
            child.close()
        if self.gate is not None and self.parent is None:
            try:
                self.backend.beats_gone(self.gate.member)
            except self.backend_errors as exc:
                logger.warning("beat: could not drop this beat's heartbeat (it expires by itself): %s", exc)
        super().close()

    def merge_inplace(self, b: dict[str, Any]) -> None:
        """Build entries one by one: a broken entry is logged and left out, never fatal."""
        schedule = self.schedule
        for key, spec in (b or {}).items():
            try:
                schedule[key] = self.Entry(**dict(config_spec(key, spec), name=key, app=self.app))
            except Exception as exc:
                self._broken(key, f"invalid entry: {exc.__class__.__name__}: {exc}")
                schedule.pop(key, None)
        self._plan_all()

    def _plan_all(self) -> None:
        self.plans = {}
        for name, entry in list(self.schedule.items()):
            try:
                self.plans[name] = entry_plan(entry, self.config, self.app)
            except Exception as exc:
                self._broken(name, str(exc))

    # --- the loop -----------------------------------------------------------------
    def _tick(self) -> float:
        """One tick of each shard this beat leads whose own wait is over (shard 0's, then the others');
        the shortest wait left. Each held shard keeps the cadence of one leader (it ticks when the wait
        its last tick returned is over, or at once when its lease is new); a standby shard only looks
        whether its lease thread took the lease, with no backend call.
        """
        if not self.shard_children:
            return self._tick_shard()
        wait = self._tick_if_due()
        for child in self.shard_children:
            wait = min(wait, child._tick_if_due())
        return wait

    def _tick_if_due(self) -> float:
        """This shard's tick when it leads and its wait is over (or its lease is new); the wait left."""
        term = self.keeper.term
        if term is None:
            self._next_tick = None
            return self._tick_shard()  # a standby's tick: no backend call, the wake-up wait
        now = self.clock.time()
        due_at = self._next_tick if self._ticked_term == term else None
        # (a wait longer than one tick left means the clock went back: tick now)
        if due_at is not None and now < due_at <= now + self.granularity:
            return due_at - now
        wait = self._tick_shard()
        self._ticked_term = term
        self._next_tick = self.clock.time() + wait
        return wait

    def _tick_shard(self) -> float:
        term = self.keeper.term
        if term is None:
            self._reconciled = None
            return self.standby_wait
        epoch = term.epoch
        try:
            if self._reconciled == term:
                self.replan_step()  # a plan of every entry goes a chunk per tick (replan.py)
            now = self.clock.time()
            # once per lease, keyed on the term: an epoch number repeats after a backend reset
            if self._reconciled != term:
                self.reconcile(epoch, now)
                self._reconciled = term
            due, lost, version, head = self._read_due(now)
            if version > self.seen_version:
                # runtime entries changed (or a run-now came in): apply just those, then look again
                if not self.apply_changes(epoch, now, version):
                    return self.granularity
                due, lost, _, head = self._read_due(now)
            if lost:
                # The due set or the state hash lost entries while the lease survived (eviction,
                # a DEL by hand): nothing would ever be due again, silently. Rebuild it now.
                logger.warning("beat: %s; reconciling the schedule", lost)
                self.reconcile(epoch, now, full=True)
                due, _, _, head = self._read_due(now)
            with collector_paused(len(due) >= C.BEAT_BURST_NO_GC):
                if self.lazy:  # the definitions of the due entries, where this leader has not built them
                    self._load([n for n, _ in due if n not in self.runtime and n not in self.config_names])
                if not self.fire_due(due, now, epoch):
                    return self.granularity
            if len(due) == C.BEAT_DUE_BATCH:
                return 0.0
            if due:  # the fired entries moved on: the next one due is somewhere else now
                head = self.backend.head()
            if self.lazy:
                self._evict()
            self._housekeeping()
            self._expire_pauses(now)
        except LeaseLost as exc:
            # Not a backend error (each backend has its own, and this one must be caught on all of
            # them): this beat was paused past its lease and another took it over.
            self.keeper.step_down(str(exc))
            return self.granularity
        except self.backend_errors as exc:
            return self.backend_failed(exc)
        wait = self.granularity if not head else max(0.0, min(head[0][1] - self.clock.time(), self.granularity))
        if self.pause_expiry:
            wait = min(wait, max(0.0, min(self.pause_expiry.values()) - self.clock.time()))
        if self.seen_version > 0:
            # runtime entries are in use: look at the change counter often, a change shows within a poll
            wait = min(wait, C.BEAT_CHANGES_POLL)
        return 0.0 if self.replanning else wait

    def _read_due(self, now: float) -> tuple[list[tuple[str, float]], str | None, int, list[tuple[str, float]]]:
        """The due entries, what is missing from the backend's state (None when nothing is), the change
        counter of the runtime entries, and the first entry of the due set (how long to sleep): all in
        the one round trip of an idle tick. After a reconcile every planned entry is in the due set and
        the state, and only the leader removes them, so the counts tell a loss.
        """
        read = self.backend.read_due(now, C.BEAT_DUE_BATCH)
        planned = len(self.plans)
        if self.lazy:
            # only the config entries are known to be planned (the runtime ones are not all loaded): a
            # lower bound, counted only when the counts fall below it
            planned = 0
            if min(read.due_count, read.state_count) < len(self.config_names):
                planned = sum(1 for name in self.config_names if name in self.plans)
        lost = None
        if read.due_count < planned:
            lost = f"{self.backend.due_name} has {read.due_count} of {planned} entries (evicted or deleted?)"
        elif read.state_count < planned:
            lost = f"{self.backend.state_name} has {read.state_count} of {planned} entries (evicted or deleted?)"
        return read.due, lost, read.version, read.head

    # --- runtime entries ----------------------------------------------------------
    def apply_changes(self, epoch: int, now: float, version: int) -> bool:
        """Apply the runtime entries changed since ``seen_version`` and the run-now requests; False
        when the lease turned out to be gone. Reads only the changed names (one round trip for the
        log, one for their definitions and state), then writes their state in one more."""
        changed = self.backend.change_log(self.seen_version, C.BEAT_CHANGES_BATCH)
        requests = self.backend.run_now_requests()
        names = [name for name, _ in changed if self.owns(name)]
        writes: list[SlotWrite] = []
        catch_up: list[tuple[float, SlotWrite]] = []
        forget: dict[bool, list[str]] = {True: [], False: []}  # keep_state -> names
        expiring: dict[str, float | None] = {}  # the changed names' pause expiries (None: none)
        if names:
            raws, states, scores = self.backend.read_changed(names)
            for name, raw, state, score in zip(names, raws, states, scores, strict=True):
                became = self.load_runtime(name, raw)
                expiring[name] = self.pause_expiry.get(name)
                if became == "active":
                    known = load_state(state)
                    plan = self.plans[name]
                    # out of the due set with its state kept: it was paused (or broken) and is back
                    resumed = bool(known) and score is None and known.get("sig") == plan.signature
                    planned = next_state(plan, known, score, now, name=name, resumed=resumed)
                    if planned is None:
                        continue
                    written, due = planned
                    slot = state_next(load_state(written))
                    if resumed:
                        logger.info(
                            "beat: entry %r resumed; next slot %s (slots that fell while it was paused are skipped)",
                            name,
                            to_datetime(slot).isoformat() if slot != NEVER else None,
                        )
                    # only its jitter changed: the same slot at another instant, due as usual
                    moved = score is not None and known.get("sig") == plan.signature
                    if known and due <= now and not moved:
                        # Edited onto a grid whose next slot already passed: those slots fell before
                        # the edit, so none counts as on time; its misfire policy decides from now
                        # (run_once: one catch-up run).
                        catch_up.extend((slot, w) for w in self.plan_entry(name, slot, now, on_time=0.0))
                    else:
                        writes.append(SlotWrite(name, written, due))
                elif became in ("paused", "broken"):
                    forget[True].append(name)
                elif became == "removed":
                    forget[False].append(name)
            logger.info(
                "beat: applied %d runtime entry change(s) (version %s): %d rescheduled, %d paused or broken, "
                "%d removed",
                len(names),
                int(changed[-1][1]),
                len(writes),
                len(forget[True]),
                len(forget[False]),
            )
        if writes and any(v < 0 for v in self.lease.write_slots(epoch, writes)):
            return self._refused(writes[0].entry, writes[0].next_fire)
        for keep_state, batch in forget.items():
            if not self.lease.forget(epoch, batch, keep_state=keep_state):
                return self._refused(batch[0], now)
        if not self.write_and_publish(catch_up, epoch):
            return False
        if forget[False]:  # applied: the tombstones have done their job (a name saved again is kept)
            self.backend.prune(version, forget[False])
        if expiring:  # a next leader finds the pauses to expire without reading every definition
            self.backend.set_pause_expiries(
                {n: t for n, t in expiring.items() if t is not None}, [n for n, t in expiring.items() if t is None]
            )
        self.changes_behind = len(changed) == C.BEAT_CHANGES_BATCH
        if self.changes_behind:
            self.seen_version = int(changed[-1][1])  # more to read: the next tick goes on from here
        else:
            # every change up to ``version`` is in the log (the scripts bump both atomically)
            self.seen_version = max([version, *(int(score) for _, score in changed)])
        self._mark_applied()
        return self.run_requested(epoch, requests)

    def run_requested(self, epoch: int, requests: dict[str, str]) -> bool:
        """Publish the ``beat run-now`` requests: one slot each (the request instant), guarded."""
        if self.lazy:
            self._load([n for n in requests if n not in self.runtime and n not in self.config_names and self.owns(n)])
        for name, slot_ms in requests.items():
            if not self.owns(name):
                continue  # another shard's leader publishes it
            entry = self.schedule.get(name) or self.paused.get(name)
            slot = int(slot_ms) / 1000.0
            if entry is not None:
                verdict = self.lease.dispatch_slot(epoch, name, slot)
                if verdict < 0:
                    return self._refused(name, slot)
                if verdict > 0:
                    logger.info("beat: entry %r run now (requested slot %s)", name, to_datetime(slot).isoformat())
                    self._task_ids.update(history.record_published(self.backend, name, slot, epoch, "run-now"))
                    self.publish(entry, slot, epoch)
            else:
                logger.warning("beat: run-now of unknown entry %r dropped", name)
            self.backend.run_now_done(name, slot_ms)
        return True

    def _housekeeping(self) -> None:
        """Prune old fired-slot records where they do not expire by themselves (PostgreSQL), every
        ``BEAT_PRUNE_INTERVAL`` seconds of the leader's clock."""
        now = self.clock.time()
        if now - self._pruned_at < C.BEAT_PRUNE_INTERVAL:
            return
        self._pruned_at = now
        pruned = self.backend.prune_fired(self.lease.token)
        if pruned:
            logger.info("beat: pruned %d fired-slot record(s) older than %d s", pruned, C.FIRED_SLOT_TTL)

    def fire_due(self, due: list[tuple[str, float]], now: float, epoch: int) -> bool:
        """Guard and publish the due entries; False when the lease turned out to be gone.

        The dispatch checks of all due entries go to the backend in one round trip, then the slots they
        allow are published: a tick with N entries due costs one backend round trip, not N.
        """
        planned: list[tuple[float, SlotWrite]] = []  # (the due slot it came from, the write)
        for name, slot in self._due_slots(due):
            try:
                planned.extend((slot, write) for write in self.plan_entry(name, slot, now))
            except self.backend_errors:
                raise
            except Exception:
                logger.exception("beat: entry %r failed; the other entries keep firing", name)
        return self.write_and_publish(planned, epoch)

    def _due_slots(self, due: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """The slots of the due entries: the due score itself, except for jittered entries, whose
        score is their slot plus its offset and whose slot is read from their state (one more round
        trip, only in a tick where a jittered entry is due)."""
        jittered = [name for name, _ in due if (plan := self.plans.get(name)) is not None and plan.jitter > 0]
        if not jittered:
            return due
        raws, _ = self.backend.read_states(jittered)
        slots: dict[str, float] = {}
        for name, raw in zip(jittered, raws, strict=True):
            state = load_state(raw)
            if state.get("sig") == self.plans[name].signature and state.get("next") is not None:
                slots[name] = float(state["next"])
        out: list[tuple[str, float]] = []
        for name, score in due:
            slot = slots.get(name)
            if slot is None and name in jittered:  # the state was lost: find the slot from the score
                slot = self.plans[name].slot_at(name, score)
            out.append((name, score if slot is None else slot))
        return out

    def write_and_publish(self, planned: list[tuple[float, SlotWrite]], epoch: int) -> bool:
        """Send ``planned`` (due slot, write) pairs in one round trip and publish the slots the guard
        allows; False when the lease turned out to be gone."""
        if not planned:
            return True
        # each slot's run record (and the task id it names) rides in the same round trip
        writes, self._task_ids = history.stamp_writes(
            [write for _, write in planned], epoch, self.clock.time(), self.config.beat_history_size
        )
        verdicts = self.lease.write_slots(epoch, writes)
        allowed: list[tuple[Any, float]] = []  # published also when this stops half way: they are marked fired
        try:
            for (due_slot, write), verdict in zip(planned, verdicts, strict=True):
                if verdict < 0:
                    return self._refused(write.entry, write.slot if write.slot is not None else due_slot)
                if write.next_fire == NEVER:
                    self._finished(write.entry)
                if write.slot is None:
                    continue
                if verdict == 0:
                    logger.warning(
                        "beat: entry %r slot %s was already fired; not publishing it again", write.entry, write.slot
                    )
                    signals.beat_slot_duplicate.send(
                        sender=self, entry=write.entry, slot=to_datetime(write.slot), reason="already fired"
                    )
                    continue
                entry = self.schedule.get(write.entry)
                if entry is not None:
                    allowed.append((entry, write.slot))
            return True
        finally:
            self.publish_many(allowed, epoch)
            self._task_ids = {}

    def publish_many(self, allowed: list[tuple[Any, float]], epoch: int) -> None:
        """Publish a tick's allowed slots; on a Redis broker in one round trip (kombu's ``Producer.batch``:
        the same LPUSHes through Celery's ``send_task``, routing, headers and publish signals kept), on
        SQS in ``SendMessageBatch`` calls of 10.

        A slot is logged and signalled as sent only once its batch reached the broker: a batch that
        fails is lost as a whole and logged slot by slot (at most once, as a single failed publish);
        a message SQS refuses on its own (too large) is logged as not published, the rest go out.
        """
        if len(allowed) < 2 or not publishes_in_batches(self.producer):
            for entry, slot in allowed:
                self.publish(entry, slot, epoch)  # logs its own failures, never raises
            return
        sent: list[tuple[Any, float, Any, dict[str, Any]]] = []
        batch = PublishBatch()
        tried = 0
        try:
            with batched_publish(self.producer, len(allowed), batch):
                for entry, slot in allowed:
                    published = self._send(entry, slot, epoch)
                    tried += 1
                    if published is not None:
                        sent.append((entry, slot, *published))
        except Exception as exc:
            # the slots _send dropped or refused are recorded already; the buffered ones took their
            # overlap markers, which go back
            error = f"batch of {len(allowed)} failed: {exc}"
            for entry, slot, _, options in sent:
                self._not_published(entry, slot, error, options)
            for entry, slot in allowed[tried:]:
                self._not_published(entry, slot, error)
            return
        # one line per batch: a burst (many entries due at once) shows as its chunks
        logger.debug("beat: published %d due slot(s) in one batch", len(sent) - len(batch.refused))
        for entry, slot, result, options in sent:
            refusal = batch.refused.get(getattr(result, "id", None) or "")
            if refusal is None:
                self._sent(entry, slot, epoch, result)
            else:
                self._not_published(entry, slot, refusal, options)

    def _not_published(
        self, entry: Any, slot: float, error: BaseException | str, options: Mapping[str, Any] | None = None
    ) -> None:
        """Log and record a slot that was claimed but not published (at most once: it stays marked
        fired), and free the overlap marker its publish took (else it counts as queued until it expires)."""
        logger.error("beat: entry %r slot %s not published: %s", entry.name, to_datetime(slot).isoformat(), error)
        if options is not None:
            self.overlap_gate.unpublished(entry.name, options)
        history.not_published(self.backend, entry.name, slot, self.clock.time(), error)

    def _expire_pauses(self, now: float) -> None:
        """Resume the paused entries whose pause expired: a compare-and-set of their definition, as
        ``resume`` does (a save made meanwhile is kept). The change counter moves, so the resume is
        applied like any other at the next tick: the entry continues at its next slot."""
        for name, until in list(self.pause_expiry.items()):
            if until > now:
                continue
            del self.pause_expiry[name]
            raw = self.runtime.get(name)
            if raw is None and self.lazy:
                # not built here: read it, and resume it only if it is still paused until then
                (raw,) = self.backend.definitions([name])
                try:
                    stored_until = None if raw is None else paused_until(parse_definition(raw))
                    if stored_until is None or abs(stored_until - until) > 0.001:
                        continue
                except ScheduleError:
                    continue
            if raw is not None:
                self._store_enabled(
                    name, raw, True, "the pause of entry %r expired: resumed", "the pause of entry %r expired but it"
                )

    def _finished(self, name: str) -> None:
        """A runtime one-off has no slot left (fired, or skipped by its misfire policy): store its
        definition as disabled, so that every reader sees it paused. A compare-and-set on the definition
        this leader loaded: a save made meanwhile (a new instant) is kept and applied next tick."""
        raw = self.runtime.get(name)
        entry = self.schedule.get(name)
        if raw is None or entry is None or not isinstance(entry.schedule, at):
            return
        self._store_enabled(
            name, raw, False, "one-off entry %r has no slot left: disabled", "one-off entry %r fired but"
        )

    def _store_enabled(self, name: str, raw: Any, enabled: bool, done: str, failed: str) -> None:
        """Compare-and-set ``name``'s loaded definition ``raw`` to ``enabled``; log ``done`` when it changed
        (with the new version), ``failed`` when it could not be rewritten (backend errors propagate)."""
        try:
            audit = history.audit_meta(
                self.config, "resume" if enabled else "disable", history.beat_changer(), self.clock.time()
            )
            verdict = self.backend.swap_definition(name, raw, with_enabled(name, raw, enabled), audit)
        except self.backend_errors:
            raise
        except Exception as exc:  # a definition this leader could load is always rewritable; be safe anyway
            action = "resumed" if enabled else "disabled"
            logger.warning("beat: " + failed + " could not be %s: %s", name, action, exc)  # noqa: G003
            return
        if verdict > 0:
            logger.info("beat: " + done + " (version %s)", name, verdict)  # noqa: G003

    def plan_entry(self, name: str, slot: float, now: float, on_time: float | None = None) -> list[SlotWrite]:
        """The state writes for one due entry: a dispatch per slot to publish, else one advance.

        ``on_time``: how old a slot may be and still count as on time (default: one lease).
        """
        plan = self.plans.get(name)
        entry = self.schedule.get(name)
        if plan is None or entry is None:
            # A save seeds a new entry's due time (entries.py) before this leader applies the change:
            # while changes are still to apply, an entry it does not know yet keeps its place.
            if not self.changes_behind:
                self.backend.drop_due(name)
            return []
        on_time = self.config.beat_lease if on_time is None else on_time
        try:
            decision = plan.decide(name, slot, now, on_time=on_time, grace=self.config.misfire_grace)
        except Exception as exc:
            self._broken(name, f"cannot compute its next slot: {exc}")
            self.plans.pop(name, None)
            self.backend.drop_due(name)
            return []
        sig = plan.signature
        if decision.missed > decision.expired:
            logger.warning(
                "beat: entry %r missed %d slot(s) up to %s (misfire policy %s)",
                name,
                decision.missed - decision.expired,
                to_datetime(decision.last_due).isoformat(),
                plan.policy,
            )
        if decision.expired:
            logger.warning(
                "beat: entry %r skipped %d slot(s) up to %s: later than its catch-up window (%g s)",
                name,
                decision.expired,
                to_datetime(decision.last_due).isoformat(),
                plan.catchup_window,
            )
            beat_slots_past_catchup.send(sender=self, entry=name, count=decision.expired)
        due = plan.due_at(name, decision.next)
        if not decision.fire:
            return [SlotWrite(name, dump_state(decision.last_due, decision.next, sig), due)]
        return [SlotWrite(name, dump_state(s, decision.next, sig), due, s) for s in decision.fire]

    def _refused(self, name: str, slot: float) -> bool:
        signals.beat_slot_duplicate.send(sender=self, entry=name, slot=to_datetime(slot), reason="not the leader")
        self.keeper.step_down("the dispatch check refused: another beat holds the lease")
        return False

    def publish(self, entry: Any, slot: float, epoch: int) -> None:
        published = self._send(entry, slot, epoch)
        if published is not None:
            self._sent(entry, slot, epoch, published[0])

    def _send(self, entry: Any, slot: float, epoch: int) -> tuple[Any, dict[str, Any]] | None:
        """Publish one slot (or buffer it, inside a batch): its result and the options it went with;
        None when it was dropped or failed (logged and recorded)."""
        when = to_datetime(slot)
        task_id = self._task_ids.pop((entry.name, slot), None)  # the id its run record names
        try:
            extra = self.overlap_gate.admit(entry.name, entry.options, slot, task_id=task_id)
        except ScheduleError as exc:
            self._not_published(entry, slot, exc)
            return None
        if extra is None:  # dropped by its overlap policy (logged and signalled)
            history.dropped(self.backend, entry.name, slot, self.clock.time())
            return None
        headers = {C.HEADER_SLOT: when.isoformat(), C.HEADER_EPOCH: epoch, C.HEADER_ENTRY: entry.name}
        options = slot_options(entry.options, extra, headers, task_id)
        proxy = copy.copy(entry)
        proxy.options = options
        try:
            return super().apply_async(proxy, producer=self.producer, advance=False), options
        except Exception as exc:
            # At most once: the slot is marked fired; a lost publish is logged, not retried.
            self._not_published(entry, slot, exc, options)
            return None

    def _sent(self, entry: Any, slot: float, epoch: int, result: Any) -> None:
        when = to_datetime(slot)
        entry.last_run_at = when
        entry.total_run_count += 1
        task_id = getattr(result, "id", None)
        # The sweep goes every few seconds: at INFO it would fill the log.
        level = logging.DEBUG if entry.task == C.SWEEP_TASK_NAME else logging.INFO
        logger.log(
            level, "beat: sending due task %s (%s) slot %s epoch %s", entry.name, entry.task, when.isoformat(), epoch
        )
        signals.beat_slot_dispatched.send(sender=self, entry=entry.name, slot=when, epoch=epoch, task_id=task_id)
