"""Backfill: publish the past slots of a beat entry that were not fired, each at most once.

``backfill(name, start, end)`` (``celery safe-time beat backfill NAME --from ... --to ...``) walks the entry's
schedule over ``[start, end)`` and publishes every slot without a fired-slot record, writing the record the
leader's dispatch guard writes: neither the leader, nor another backfill, nor the same one run twice publishes
such a slot again. No lease is needed: the record itself is the guard. Published tasks carry the
``safe_time_slot`` header, and ``safe_time_backfill`` (the backfill's id) in place of ``safe_time_epoch``.

The slots go through the entry's overlap gate (:mod:`.overlap`) in one go, with its own policy or the one the
backfill names: ``allow`` and ``buffer_all`` publish every slot (``buffer_all`` runs them one at a time, in
slot order), ``skip`` publishes the first only when no run is queued or running and ``buffer_one`` the first
only, dropping the rest, and ``cancel_other`` leaves the last slot's run (each slot revokes the one before).
A dropped slot stays fired: ``dropped`` in the run history, not published by a later backfill.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from datetime import datetime
from typing import Any

from celery import Celery

from .. import constants as C
from ..clock import UTC, to_datetime
from ..exceptions import ScheduleError
from .base import stop_signals_held
from .entries import EntryInfo, _Store, get_entry
from .history import dropped, not_published, record_audit, record_published
from .overlap import OverlapGate, slot_options
from .policies import OPTION_OVERLAP, overlap_option
from .slots import NEVER, Grid, IntervalGrid, grid_for
from .state import load_state

__all__ = ["BackfillResult", "backfill", "backfill_slots", "run_backfill"]

logger = logging.getLogger(__name__)


def _aware(value: Any, what: str) -> datetime:
    if not isinstance(value, datetime):
        raise ScheduleError(f"backfill {what} must be a datetime, got {value!r}")
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _interval_anchor(grid: IntervalGrid, state: Any) -> float | None:
    """A slot of an interval entry's grid (its anchor is where the leader first planned it): the
    state's next slot when the state is of this grid, else its last fired slot (an edited interval
    continues after it); None when no leader planned the entry yet."""
    known = load_state(state)
    nxt, last = known.get("next"), known.get("last")
    if known.get("sig") == grid.signature() and nxt is not None:
        return float(nxt)
    if last is not None:
        return float(last)
    return None if nxt is None else float(nxt)


def backfill_slots(grid: Grid, start: float, end: float, limit: int, anchor: float | None = None) -> list[float]:
    """The slots of ``grid`` in ``[start, end)`` (UNIX seconds), ascending; :class:`ScheduleError`
    naming the count when there are more than ``limit``. An interval grid needs ``anchor`` (one of
    its slots). Pure: no backend, no clock."""
    out: list[float] = []
    if isinstance(grid, IntervalGrid):
        if anchor is None:
            raise ScheduleError("an interval entry's slots start where the beat leader first planned it")
        step = grid.seconds
        k, last_k = math.ceil((start - anchor) / step), math.ceil((end - anchor) / step) - 1
        count = max(0, last_k - k + 1)
        if count > limit:
            raise ScheduleError(f"{count} slots in the range, more than the limit of {limit}")
        out = [anchor + i * step for i in range(k, last_k + 1)]
        # a float step may put a slot a hair outside the range: the range decides
        return [slot for slot in out if start <= slot < end]
    slot = grid.next(start - 0.001)  # the first slot at or after start (slots are whole milliseconds)
    while slot != NEVER and slot < end:
        if slot >= start:
            out.append(slot)
            if len(out) > limit:
                more = _count(grid, slot, end, limit)
                raise ScheduleError(f"{more} slots in the range, more than the limit of {limit}")
        nxt = grid.next(slot)
        if nxt <= slot:  # a schedule that does not move forward: stop rather than loop
            break
        slot = nxt
    return out


def _count(grid: Grid, slot: float, end: float, limit: int) -> str:
    """How many slots from ``slot`` to ``end`` (counted up to a bound; "over N" beyond it)."""
    count = limit + 1
    bound = C.BEAT_CATCHUP_SCAN_LIMIT
    while count < bound:
        slot = grid.next(slot)
        if slot == NEVER or slot >= end:
            return str(count)
        count += 1
    return f"over {bound}"


def backfill(
    name: str,
    start: datetime,
    end: datetime,
    app: Celery | None = None,
    *,
    limit: int = C.BEAT_BACKFILL_MAX,
    changed_by: str | None = None,
    overlap: str | None = None,
) -> list[datetime]:
    """Publish every slot of the entry ``name`` in ``[start, end)`` that was not fired, each at most
    once (whoever else publishes it: the leader, another backfill). Returns the slots this call
    published, ascending (:func:`run_backfill` also gives the slots the overlap policy dropped).

    ``start`` and ``end`` are aware datetimes (naive means UTC); ``end`` at most now, ``start`` at
    most ``BEAT_BACKFILL_HORIZON`` ago (fired-slot records are kept ``FIRED_SLOT_TTL``: older slots
    cannot be told fired or not). More than ``limit`` slots in the range: :class:`ScheduleError`
    naming the count, nothing published. A paused entry is backfilled too (as ``run_now`` runs it).
    Each published slot goes into the entry's run history, and the backfill into its audit (as by
    ``changed_by``, default ``user@host pid N``). ``overlap`` is the overlap policy the slots go
    through (None: the entry's own); a bad one raises :class:`ScheduleError`, nothing published.
    """
    return run_backfill(name, start, end, app, limit=limit, changed_by=changed_by, overlap=overlap).published


@dataclasses.dataclass(frozen=True)
class BackfillResult:
    """What one backfill did: the slots it published and the slots the overlap policy dropped
    (both ascending; slots fired before are in neither)."""

    published: list[datetime]
    dropped: list[datetime]


def run_backfill(
    name: str,
    start: datetime,
    end: datetime,
    app: Celery | None = None,
    *,
    limit: int = C.BEAT_BACKFILL_MAX,
    changed_by: str | None = None,
    overlap: str | None = None,
) -> BackfillResult:
    """:func:`backfill`, returning the dropped slots too."""
    start, end = _aware(start, "start"), _aware(end, "end")
    if end <= start:
        raise ScheduleError(
            f"backfill of {name!r}: the end {end.isoformat()} is not after the start {start.isoformat()}"
        )
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ScheduleError(f"backfill of {name!r}: the limit must be a positive number of slots, got {limit!r}")
    store = _Store(app)
    now = store.backend.clock.time()
    if end.timestamp() > now:
        raise ScheduleError(
            f"backfill of {name!r}: the end {end.isoformat()} is in the future (now {to_datetime(now).isoformat()}); "
            "backfill publishes past slots only"
        )
    oldest = now - C.BEAT_BACKFILL_HORIZON
    if start.timestamp() < oldest:
        raise ScheduleError(
            f"backfill of {name!r}: the start {start.isoformat()} is before {to_datetime(oldest).isoformat()}: "
            f"fired slots are remembered {C.FIRED_SLOT_TTL // 86400} days, so older ones cannot be told "
            "fired or not"
        )
    info = get_entry(name, app=store.app)
    if info is None:
        raise ScheduleError(f"no beat entry {name!r}")
    options = dict(info.options)
    if overlap is not None:
        options[OPTION_OVERLAP] = overlap_option(overlap, name)
    slots = _slots(store, info, start.timestamp(), end.timestamp(), limit)
    marker = f"backfill:{uuid.uuid4().hex[:12]}"
    gate = OverlapGate(store.app, store.backend.config)
    published: list[datetime] = []
    skipped: list[datetime] = []
    failed = 0
    for i in range(0, len(slots), C.BEAT_BACKFILL_BATCH):
        batch = slots[i : i + C.BEAT_BACKFILL_BATCH]
        # a stop signal between claiming a slot and publishing it would lose the slot: held until
        # the batch is out, as a beat tick holds it
        with stop_signals_held():
            claimed = store.backend.claim_slots(name, batch, marker)
            for slot, mine in zip(batch, claimed, strict=True):
                if not mine:
                    continue
                outcome = _publish(store, gate, info, options, slot, marker)
                if outcome == "published":
                    published.append(to_datetime(slot))
                elif outcome == "dropped":
                    skipped.append(to_datetime(slot))
                else:
                    failed += 1
    logger.info(
        "beat: backfill %s of entry %r over [%s, %s): %d slot(s), %d published, %d dropped by its overlap policy, "
        "%d fired already, %d failed",
        marker,
        name,
        start.isoformat(),
        end.isoformat(),
        len(slots),
        len(published),
        len(skipped),
        len(slots) - len(published) - len(skipped) - failed,
        failed,
    )
    record_audit(
        store.backend, name, "backfill", changed_by, now, start=start.isoformat(), end=end.isoformat(),
        slots=len(slots), published=len(published), dropped=len(skipped), failed=failed, backfill=marker,
        overlap=options.get(OPTION_OVERLAP, "allow"),
    )  # fmt: skip
    return BackfillResult(published, skipped)


def _slots(store: _Store, info: EntryInfo, start: float, end: float, limit: int) -> list[float]:
    try:
        grid = grid_for(info.schedule, store.app.timezone)
        anchor = None
        if isinstance(grid, IntervalGrid):
            (state,), _, _ = store.backend.entry_rows([info.name])
            anchor = _interval_anchor(grid, state)
        return backfill_slots(grid, start, end, limit, anchor)
    except ScheduleError as exc:
        raise ScheduleError(f"backfill of {info.name!r}: {exc}") from None


def _publish(
    store: _Store, gate: OverlapGate, info: EntryInfo, entry_options: dict[str, Any], slot: float, marker: str
) -> str:
    """Send one slot as beat sends it (the entry's options, less ours, plus the slot header, through
    the overlap gate): ``published``, ``dropped`` (by the overlap policy: logged and signalled by the
    gate) or ``failed`` (logged). Either way the slot stays marked fired, so it is not sent again."""
    app = store.app
    when = to_datetime(slot)
    task_id = record_published(store.backend, info.name, slot, None, "backfill").get((info.name, slot))
    try:
        extra = gate.admit(info.name, entry_options, slot, task_id=task_id)
    except ScheduleError as exc:
        return _not_published(store, info.name, slot, exc)
    if extra is None:
        dropped(store.backend, info.name, slot, store.backend.clock.time())
        return "dropped"
    headers = {C.HEADER_SLOT: when.isoformat(), C.HEADER_BACKFILL: marker, C.HEADER_ENTRY: info.name}
    options = slot_options(entry_options, extra, headers, task_id)
    try:
        task = app.tasks.get(info.task)
        if task is not None:
            task.apply_async(info.args, info.kwargs, **options)
        else:
            app.send_task(info.task, info.args, info.kwargs, **options)
    except Exception as exc:
        gate.unpublished(info.name, options)  # the overlap marker its publish took
        return _not_published(store, info.name, slot, exc)
    logger.info("beat: backfill %s sent entry %r (%s) slot %s", marker, info.name, info.task, when.isoformat())
    return "published"


def _not_published(store: _Store, name: str, slot: float, error: BaseException) -> str:
    """Log and record a slot this backfill claimed and did not publish (it stays claimed: at most once)."""
    logger.error("beat: backfill of entry %r slot %s not published: %s", name, to_datetime(slot).isoformat(), error)
    not_published(store.backend, name, slot, store.backend.clock.time(), error)
    return "failed"
