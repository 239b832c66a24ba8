"""Runtime beat entries: add, change, pause and remove periodic tasks without restarting beat.

The definitions live in the app's beat backend, next to the schedule state: on Redis the keys below (behind
``safe_time_key_prefix``; any language can read and write them), on PostgreSQL the tables
``safe_time_beat_entries``, ``safe_time_beat_changes``, ``safe_time_beat_meta`` and ``safe_time_beat_run_now``
with the same JSON and the same counter (docs/beat.md lists them).

- ``beat:entries`` (hash): entry name -> its definition, canonical JSON::

      {"format": 1, "name": "tenant-42-report", "task": "reports.send",
       "schedule": {"type": "crontab", "minute": "0", "hour": "9", "day_of_week": "*",
                    "day_of_month": "*", "month_of_year": "*", "tz": "Europe/Berlin"},
       "args": [42], "kwargs": {}, "options": {"queue": "reports"}, "enabled": true}

  ``schedule`` is one of ``{"type": "interval", "every": seconds}``, ``crontab`` (as above; ``tz`` null means
  the app timezone), ``{"type": "solar", "event": ..., "lat": ..., "lon": ...}``, ``{"type": "rrule", "rule":
  "FREQ=DAILY;BYHOUR=9", "dtstart": "2026-01-01T09:00:00", "tz": "Europe/Berlin"}`` (``tz`` null: ``dtstart``
  carries an offset or is UTC) and ``{"type": "at", "at": "2026-12-01T09:00:00+00:00"}`` (one-off).
- ``beat:entries:version`` (counter) and ``beat:entries:changed`` (zset name -> version of its last change; a
  deleted entry stays as a tombstone). Writers go through ``lua/save_entry.lua`` and ``lua/delete_entry.lua``
  (EVAL them from any client), which bump both atomically (on PostgreSQL, one statement each). The leader
  reads the counter in every tick's due read and, when it moved, only the changed names: a change takes
  effect at the leader's next tick, whatever the number of entries.

Per-entry state (last fired slot, next slot) is the scheduler's usual state (Redis: ``beat:state`` /
``beat:due``; PostgreSQL: ``safe_time_beat_state``), so a definition that did not change keeps it, and a pause
keeps it for the resume.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from celery import Celery, current_app
from celery.schedules import schedule as celery_interval

from .. import constants as C
from ..clock import UTC
from ..config import get_config
from ..exceptions import SafeTimeError, ScheduleError, SerializationError
from .backends import beat_backend
from .backends.base import Seed
from .definitions import (
    build_entry,
    cached_schedule,
    canonical_json,
    definition_json,
    definition_text,
    parse_definition,
    paused_until,
    schedule_from_spec,
    schedule_to_spec,
    spec_key,
)
from .history import audit_meta, record_audit
from .policies import OPTION_JITTER, config_spec, policy_options
from .slots import NEVER, Plan, at, entry_plan, grid_for, next_state, rrule
from .state import epoch, instant, load_state, slot_id, state_next

logger = logging.getLogger(__name__)

__all__ = [
    "EntryInfo",
    "at",
    "build_entry",
    "cron_spec",
    "definition_json",
    "delete_entry",
    "describe_schedule",
    "get_entry",
    "list_entries",
    "parse_definition",
    "pause",
    "resume",
    "rrule",
    "run_now",
    "run_now_fired",
    "save_entries",
    "save_entry",
    "schedule_from_spec",
    "schedule_to_spec",
    "set_enabled",
    "spec_key",
    "with_enabled",
]


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """One beat entry as ``get_entry`` / ``list_entries`` see it (times are aware UTC datetimes)."""

    name: str
    task: str
    schedule: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    enabled: bool
    last_fired: datetime | None
    next_fire: datetime | None
    source: str  # "config" or "runtime"
    version: int | None = None  # the change log version of a runtime entry's definition
    pause_note: str | None = None  # why a paused entry was paused (``pause(name, note=...)``)
    paused_until: datetime | None = None  # when a paused entry resumes by itself

    def as_dict(self) -> dict[str, Any]:
        try:
            spec: Any = schedule_to_spec(self.schedule)
        except ScheduleError:
            spec = repr(self.schedule)
        return {
            "name": self.name,
            "task": self.task,
            "schedule": spec,
            "args": list(self.args),
            "kwargs": self.kwargs,
            "options": self.options,
            "enabled": self.enabled,
            "last_fired": None if self.last_fired is None else self.last_fired.isoformat(),
            "next_fire": None if self.next_fire is None else self.next_fire.isoformat(),
            "source": self.source,
            "version": self.version,
            "pause_note": self.pause_note,
            "paused_until": None if self.paused_until is None else self.paused_until.isoformat(),
        }


# --- the API ------------------------------------------------------------------------------------


class _Store:
    """The app, its config and its beat backend, where the definitions live."""

    def __init__(self, app: Celery | None) -> None:
        self.app: Celery = app if app is not None else current_app._get_current_object()
        self.config = get_config(self.app)
        self.backend = beat_backend(self.config)

    def config_entries(self) -> dict[str, Any]:
        return dict(self.app.conf.beat_schedule or {})


#: The control characters (Unicode category ``Cc``: C0, DEL and C1), one search per name.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def check_entry_name(name: Any) -> None:
    """Raise :class:`ScheduleError` unless ``name`` is a non-empty string without control characters.

    A name is shown in logs, ``status`` and the admin, and is part of the entry page's URL: a newline
    or another control character would forge log lines and break that URL."""
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"entry name must be a non-empty string, got {name!r}")
    bad = _CONTROL.search(name)
    if bad is not None:
        raise ScheduleError(
            f"entry name {name!r} holds the control character {bad.group()!r}; names are single-line text"
        )


def _conflict(store: _Store, name: str, task: str) -> None:
    spec = store.config_entries().get(name)
    if spec is not None:
        other = spec.get("task") if isinstance(spec, Mapping) else getattr(spec, "task", "?")
        raise ScheduleError(
            f"runtime entry {name!r} (task {task!r}) is refused: the config entry {name!r} "
            f"(beat_schedule, task {other!r}) has that name; pick another name or remove it from beat_schedule"
        )


def save_entry(
    name: str,
    task: str,
    schedule: Any,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    enabled: bool = True,
    app: Celery | None = None,
    jitter: float | timedelta | None = None,
    catchup_window: float | timedelta | None = None,
    overlap: str | None = None,
    overlap_ttl: float | timedelta | None = None,
    changed_by: str | None = None,
) -> EntryInfo:
    """Create or replace the runtime entry ``name`` (idempotent: an unchanged definition changes
    nothing, its last and next fire included). Validates everything before storing anything:
    unknown task, bad schedule, misfire policy, jitter or catch-up window -> :class:`ScheduleError`;
    arguments that are not JSON -> :class:`SerializationError`. Takes effect at the beat leader's
    next tick. A new entry's first slot is planned with the save (its state and due time, as a leader
    plans it), so a beat that starts later finds it due without planning every entry first.

    ``jitter`` (seconds or a ``timedelta``) publishes each slot at an offset within ``[0, jitter)``
    fixed by the entry's name and the slot; ``catchup_window`` skips slots later than that. Both are
    stored in ``options`` (``safe_time_jitter``, ``safe_time_catchup_window``, in seconds).

    ``overlap`` (``allow``, ``skip``, ``buffer_one``, ``buffer_all``, ``cancel_other``) says what a
    slot does while a run of the entry is queued or running; ``overlap_ttl`` is the lease of a run in
    seconds (a killed run frees the entry that much later). Stored as ``safe_time_overlap`` and
    ``safe_time_overlap_ttl``.

    A change is recorded in the entry's audit (:func:`entry_audit`) as by ``changed_by`` (default
    ``user@host pid N``); so are the other functions' here."""
    store = _Store(app)
    raw, plan = _validated(
        store, name, task, schedule, args=args, kwargs=kwargs, options=options, enabled=enabled,
        jitter=jitter, catchup_window=catchup_window, overlap=overlap, overlap_ttl=overlap_ttl,
    )  # fmt: skip
    now = store.backend.clock.time()
    seed = _seeds([name], [plan if enabled else None], now)[0]
    store.backend.entry_save(name, raw, audit_meta(store.config, "save", changed_by, now), seed=seed)
    info = get_entry(name, app=store.app)
    assert info is not None
    return info


def _check_loadable(store: _Store, name: str, raw: str, schedule: Any, schedules: dict[Any, Any] | None) -> Plan:
    """Load the definition ``raw`` as the leader will and return its plan: an unknown task, a bad
    misfire policy or grid, and a schedule with no slot left (an rrule that ended: it would sit in the
    due set forever, unfired) raise :class:`ScheduleError` naming the entry."""
    entry = build_entry(name, parse_definition(raw), store.app, schedules)
    try:
        plan = entry_plan(entry, store.config, store.app)
    except ScheduleError:
        raise
    except SafeTimeError as exc:
        raise ScheduleError(f"entry {name!r}: {exc}") from None
    if plan.grid.first(store.backend.clock.time()) == NEVER:
        raise ScheduleError(f"entry {name!r}: schedule {schedule!r} never fires again")
    return plan


def _seeds(names: list[str], plans: list[Plan | None], now: float) -> list[Seed | None]:
    """The state and due score a save writes with each entry (None: paused, no plan): its first slot
    from ``now``, as a leader would plan it. The backend writes it only where the entry has no state
    or one that never fired, so a leader that never planned the entry (a fresh one, after a bulk
    import) finds it in the due set instead of planning every entry before it fires any.

    Entries without jitter that share a plan share one state text (the first slot is the same)."""
    firsts: dict[str, float] = {}
    shared: dict[int, Seed | None] = {}  # by id() of a plan without jitter (the plans outlive the call)
    out: list[Seed | None] = []
    for name, plan in zip(names, plans, strict=True):
        if plan is None:
            out.append(None)
        elif plan.jitter > 0:  # the due score depends on the name
            out.append(next_state(plan, {}, None, now, firsts, name=name))
        else:
            if id(plan) not in shared:
                shared[id(plan)] = next_state(plan, {}, None, now, firsts, name=name)
            out.append(shared[id(plan)])
    return out


def _validated(
    store: _Store,
    name: str,
    task: str,
    schedule: Any,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    enabled: bool = True,
    jitter: float | timedelta | None = None,
    catchup_window: float | timedelta | None = None,
    overlap: str | None = None,
    overlap_ttl: float | timedelta | None = None,
    config_entries: Mapping[str, Any] | None = None,
    checked: dict[Any, Plan] | None = None,
    schedules: dict[Any, Any] | None = None,
) -> tuple[str, Plan]:
    """The definition JSON of one entry, validated as the leader will load it (see :func:`save_entry`),
    and its plan.

    ``checked`` remembers the plans of the (schedule, task, policies) found valid, ``schedules`` the
    schedule objects, so that many entries sharing a schedule (a bulk save) are checked once per
    schedule."""
    check_entry_name(name)
    if config_entries is None or name in config_entries:
        _conflict(store, name, task)
    if schedules is not None and isinstance(schedule, Mapping):
        # a written spec: validated once per distinct spec (building a crontab is the costly part)
        spec = dict(schedule)
        cached_schedule(spec, schedules)
    else:
        spec = schedule_to_spec(schedule)
    options = policy_options(
        name, options, jitter=jitter, catchup_window=catchup_window, overlap=overlap, overlap_ttl=overlap_ttl
    )
    raw = definition_json(name, task, spec, args, kwargs or {}, options, enabled)
    key = None
    if checked is not None:
        policies = tuple(sorted((k, repr(v)) for k, v in options.items() if k.startswith("safe_")))
        key = (spec_key(spec), task, policies)
        if key in checked:
            return raw, checked[key]
    plan = _check_loadable(store, name, raw, schedule, schedules)
    if checked is not None:
        checked[key] = plan
    return raw, plan


#: The keys of one ``save_entries`` item: ``save_entry``'s parameters (``name``, ``task`` and
#: ``schedule`` required).
_SAVE_KEYS = frozenset(
    {"name", "task", "schedule", "args", "kwargs", "options", "enabled", "jitter", "catchup_window", "overlap",
     "overlap_ttl"}
)  # fmt: skip


def save_entries(
    entries: Iterable[Mapping[str, Any]], app: Celery | None = None, *, changed_by: str | None = None
) -> int:
    """Create or replace many runtime entries: each item a mapping of :func:`save_entry`'s parameters
    (``name``, ``task``, ``schedule``; optional ``args``, ``kwargs``, ``options``, ``enabled``,
    ``jitter``, ``catchup_window``, ``overlap``, ``overlap_ttl``). Returns how many changed
    (idempotent: an unchanged definition changes nothing, as with ``save_entry``).

    Entries go ``BEAT_SAVE_CHUNK`` at a time, each chunk validated whole before any of it is stored
    and then sent in one round trip (one script call): a bad entry raises :class:`ScheduleError` (or
    :class:`SerializationError`) naming the entry and the parameter, and nothing of its chunk is
    stored (earlier chunks are). A leader applies them through its change log, like single saves;
    each new entry's first slot is planned with its chunk, as :func:`save_entry` plans it.
    While one chunk is stored (a thread of this call's own), the next is validated; where the backend
    writes seeds apart (PostgreSQL), a chunk's seeds are written on one more thread once it is stored.
    """
    store = _Store(app)
    bulk = _Bulk(store)
    changed = 0
    chunk: list[tuple[str, str, Plan | None]] = []
    storing: Future[int] | None = None  # the chunk being stored
    pool: ThreadPoolExecutor | None = None
    seeding = _Seeding(store) if store.backend.seeds_apart else None
    try:
        for index, item in enumerate(entries):
            chunk.append(bulk.item(index, item))
            if len(chunk) >= C.BEAT_SAVE_CHUNK:
                if storing is not None:
                    changed += storing.result()
                if pool is None:
                    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safe-time-save-entries")
                storing = pool.submit(_store_chunk, store, chunk, changed_by, seeding)
                chunk = []
        if storing is not None:
            changed += storing.result()
            storing = None
        if chunk:
            changed += _store_chunk(store, chunk, changed_by, seeding)
    finally:
        if pool is not None:
            # a bad entry raises once the chunk before it is stored (or failed): earlier chunks are
            pool.shutdown(wait=True)
        if seeding is not None:
            seeding.wait()
    return changed


class _Seeding:
    """The seed writes of one ``save_entries`` call, a thread of their own (``seeds_apart``).

    A seed that cannot be written loses nothing: the leader plans the entry from the change log, as
    it plans an entry saved before seeds existed. So a failure is logged, not raised."""

    def __init__(self, store: _Store) -> None:
        self.backend = store.backend
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safe-time-save-seeds")
        self.writes: list[Future[None]] = []

    def submit(self, rows: list[tuple[str, Seed | None, int]]) -> None:
        self.writes.append(self.pool.submit(self.backend.entry_seed_many, rows))

    def wait(self) -> None:
        self.pool.shutdown(wait=True)
        failed = [exc for exc in (write.exception() for write in self.writes) if exc is not None]
        if failed:
            logger.warning(
                "beat: save_entries could not plan the first slot of %d chunk(s) (%s); the leader plans "
                "those entries from the change log",
                len(failed),
                failed[0],
            )


class _Bulk:
    """Validates the items of one ``save_entries`` call into (name, definition JSON).

    Thousands of entries share a handful of schedules ("09:00 in Europe/Berlin"): each distinct
    (schedule spec, task, policies) is checked as the leader loads it once, and each distinct spec
    and task is encoded once; an entry's definition is its parts joined (:func:`definition_text`,
    the bytes :func:`definition_json` gives)."""

    def __init__(self, store: _Store) -> None:
        self.store = store
        self.config_entries = store.config_entries()
        self.checked: dict[Any, Plan] = {}
        self.schedules: dict[Any, Any] = {}  # schedule objects by spec_key, shared with build_entry
        self.spec_texts: dict[Any, tuple[dict[str, Any], str]] = {}  # by _typed_key: the spec, its JSON
        self.task_texts: dict[str, str] = {}

    def item(self, index: int, item: Any) -> tuple[str, str, Plan | None]:
        """(name, definition JSON, plan; None when paused) of the ``index``-th item, validated."""
        if not isinstance(item, Mapping):
            raise ScheduleError(
                f"save_entries: entry #{index} must be a mapping of save_entry's parameters, got {item!r}"
            )
        name: Any = item.get("name")
        if not item.keys() <= _SAVE_KEYS:
            unknown = sorted(str(k) for k in item if k not in _SAVE_KEYS)
            raise ScheduleError(
                f"save_entries: entry #{index} ({name!r}): unknown parameter {unknown[0]!r} "
                f"(expected {', '.join(sorted(_SAVE_KEYS))})"
            )
        task, schedule = item.get("task"), item.get("schedule")
        for required, value in (("name", name), ("task", task), ("schedule", schedule)):
            if value is None:
                raise ScheduleError(f"save_entries: entry #{index} ({name!r}): parameter {required!r} is missing")
        if not isinstance(task, str) or not task:
            raise ScheduleError(f"save_entries: entry #{index} ({name!r}): parameter 'task' must be a task name")
        try:
            raw, plan = self._definition(name, task, schedule, item)
        except (ScheduleError, SerializationError) as exc:
            raise type(exc)(f"save_entries: entry #{index} ({name!r}): {exc}") from None
        return name, raw, plan if item.get("enabled", True) else None

    def _definition(self, name: str, task: str, schedule: Any, item: Mapping[str, Any]) -> tuple[str, Plan]:
        known = _typed_key(schedule) if isinstance(schedule, Mapping) else None
        if known is None:  # an object, or a spec with unhashable values: the general path
            params = {k: v for k, v in item.items() if k not in ("name", "task", "schedule")}
            return _validated(
                self.store, name, task, schedule, **params,
                config_entries=self.config_entries, checked=self.checked, schedules=self.schedules,
            )  # fmt: skip
        check_entry_name(name)
        if name in self.config_entries:
            _conflict(self.store, name, task)
        cached = self.spec_texts.get(known)
        if cached is None:
            spec = dict(schedule)
            cached_schedule(spec, self.schedules)  # validates
            cached = self.spec_texts[known] = (spec, canonical_json(spec))
        spec, spec_text = cached
        get = item.get
        options = get("options")
        policies: Any = ()
        if options or not item.keys() <= _NO_POLICY_KEYS:
            options = policy_options(name, options, **{k: get(k) for k in _POLICY_KEYS})
            policies = tuple(sorted((k, repr(v)) for k, v in options.items() if k.startswith("safe_")))
        task_text = self.task_texts.get(task)
        if task_text is None:
            task_text = self.task_texts[task] = canonical_json(task)
        raw = definition_text(
            name, task_text, spec_text, get("args", ()), get("kwargs"), options, bool(get("enabled", True))
        )
        check = (known, task, policies)
        plan = self.checked.get(check)
        if plan is None:
            plan = self.checked[check] = _check_loadable(self.store, name, raw, schedule, self.schedules)
        return raw, plan


#: ``save_entry``'s policy keywords (set into an entry's options), and the keys of an item without them.
_POLICY_KEYS = ("jitter", "catchup_window", "overlap", "overlap_ttl")
_NO_POLICY_KEYS = _SAVE_KEYS - frozenset(_POLICY_KEYS)


def _typed_key(spec: Mapping[str, Any]) -> Any:
    """A cache key of a spec that tells ``1``, ``1.0`` and ``True`` apart (they encode differently);
    None when a value is unhashable. Specs written in another key order are other keys (the same JSON)."""
    try:
        key = (tuple(spec.items()), tuple(map(type, spec.values())))
        hash(key)
    except TypeError:
        return None
    return key


def _store_chunk(
    store: _Store, chunk: list[tuple[str, str, Plan | None]], changed_by: str | None, seeding: _Seeding | None
) -> int:
    # each chunk plans from the clock as it is stored: a long import's last entries start on time
    now = store.backend.clock.time()
    names = [name for name, _, _ in chunk]
    seeds = _seeds(names, [plan for _, _, plan in chunk], now)
    items = [(name, raw) for name, raw, _ in chunk]
    audit = audit_meta(store.config, "save", changed_by, now)
    versions = store.backend.entry_save_many(items, audit, seeds=None if seeding else seeds)
    if seeding is not None:
        seeding.submit(list(zip(names, seeds, versions, strict=True)))
    return sum(1 for v in versions if v > 0)


def _audit(store: _Store, action: str, changed_by: str | None) -> str | None:
    return audit_meta(store.config, action, changed_by, store.backend.clock.time())


def delete_entry(name: str, app: Celery | None = None, *, changed_by: str | None = None) -> bool:
    """Delete the runtime entry ``name``; False when there is none. The leader stops it at its next
    tick. A ``beat_schedule`` entry cannot be deleted here (:class:`ScheduleError`)."""
    store = _Store(app)
    if name in store.config_entries():
        raise ScheduleError(f"{name!r} is a config entry (beat_schedule); remove it there")
    return bool(store.backend.entry_delete(name, _audit(store, "delete", changed_by)))


def with_enabled(name: str, raw: Any, enabled: bool, paused: Mapping[str, Any] | None = None) -> str:
    """The canonical definition JSON of ``raw`` with its ``enabled`` flag set, and a pause's note and
    expiry (``paused``; a resume drops them) (:class:`ScheduleError` when ``raw`` is broken)."""
    d = parse_definition(raw)
    schedule_from_spec(d["schedule"])
    return definition_json(name, d["task"], d["schedule"], d["args"], d["kwargs"], d["options"], enabled, paused)


def set_enabled(
    name: str,
    enabled: bool,
    app: Celery | None = None,
    *,
    note: str | None = None,
    until: datetime | timedelta | None = None,
    changed_by: str | None = None,
) -> EntryInfo | None:
    """Pause (False) or resume (True) a runtime entry, keeping its state; None when there is none.

    A pause may carry a ``note`` (why, who) and an expiry ``until`` (an aware datetime, naive
    means UTC, or a ``timedelta`` from now): the beat leader resumes the entry by itself then.

    A compare-and-set on the stored definition: a ``save_entry`` that lands between the read and
    the write makes it read again, so a pause never brings back the schedule it replaced.
    """
    store = _Store(app)
    if name in store.config_entries():
        raise ScheduleError(f"{name!r} is a config entry (beat_schedule); only runtime entries can be paused")
    paused = None if enabled else _pause_of(name, note, until, store.backend.clock.time())
    for _ in range(C.BEAT_ENTRY_SWAP_ATTEMPTS):
        raw = store.backend.entry_definition(name)
        if raw is None:
            return None
        audit = _audit(store, "resume" if enabled else "pause", changed_by)
        if store.backend.swap_definition(name, raw, with_enabled(name, raw, enabled, paused), audit) >= 0:
            return get_entry(name, app=store.app)
    raise ScheduleError(
        f"entry {name!r}: its definition changed under each of {C.BEAT_ENTRY_SWAP_ATTEMPTS} attempts to "
        f"{'resume' if enabled else 'pause'} it; try again"
    )


def _pause_of(name: str, note: Any, until: Any, now: float) -> dict[str, Any] | None:
    """A pause's ``paused`` JSON (None without note and expiry); :class:`ScheduleError` naming the
    entry for a note that is not text or an expiry that is not a future instant."""
    if note is not None and not isinstance(note, str):
        raise ScheduleError(f"entry {name!r}: pause note must be text, got {note!r}")
    if until is None:
        return None if note is None else {"note": note, "until": None}
    if isinstance(until, timedelta):
        when = datetime.fromtimestamp(now, UTC) + until
    elif isinstance(until, datetime):
        when = until if until.tzinfo is not None else until.replace(tzinfo=UTC)
    else:
        raise ScheduleError(f"entry {name!r}: pause until must be a datetime or a timedelta, got {until!r}")
    if when.timestamp() <= now:
        raise ScheduleError(f"entry {name!r}: pause until {when.isoformat()} is not in the future")
    return {"note": note, "until": when.astimezone(UTC).isoformat()}


def pause(
    name: str,
    *,
    note: str | None = None,
    until: datetime | timedelta | None = None,
    app: Celery | None = None,
    changed_by: str | None = None,
) -> EntryInfo | None:
    """Pause the runtime entry ``name``, with a ``note`` and an expiry ``until`` (then the leader
    resumes it by itself, at its next slot); None when there is none. See :func:`set_enabled`."""
    return set_enabled(name, False, app, note=note, until=until, changed_by=changed_by)


def resume(name: str, app: Celery | None = None, *, changed_by: str | None = None) -> EntryInfo | None:
    """Resume the runtime entry ``name`` at its next slot; None when there is none."""
    return set_enabled(name, True, app, changed_by=changed_by)


def run_now(name: str, app: Celery | None = None, *, changed_by: str | None = None) -> datetime:
    """Ask the leader to publish one extra run of ``name`` now, through the dispatch guard (its slot
    is the request instant, so the request is published at most once). Returns that slot."""
    store = _Store(app)
    if name not in store.config_entries() and store.backend.entry_definition(name) is None:
        raise ScheduleError(f"no beat entry {name!r}")
    slot = round(store.backend.clock.time(), 3)
    store.backend.entry_run_now(name, slot_id(slot))
    record_audit(store.backend, name, "run-now", changed_by, slot, slot=datetime.fromtimestamp(slot, UTC).isoformat())
    return datetime.fromtimestamp(slot, UTC)


def run_now_fired(name: str, slot: datetime, app: Celery | None = None) -> bool:
    """Whether the run-now request of ``slot`` was published (its fired-slot marker exists)."""
    return bool(_Store(app).backend.slot_fired(name, slot.timestamp()))


def _info(
    name: str,
    source: str,
    *,
    task: str,
    schedule: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any] | None,
    enabled: bool,
    state: Any,
    score: Any,
    version: Any = None,
) -> EntryInfo:
    loaded = load_state(state)
    last = loaded.get("last")
    next_score = epoch(score)
    if next_score is not None and (options or {}).get(OPTION_JITTER) and loaded.get("next") is not None:
        next_score = epoch(loaded["next"])  # the slot, not the jittered instant it is published at
    if not enabled:
        next_score = None
    # a one-off that fired is done: it reports disabled and nothing next
    if isinstance(schedule, at) and last is not None and next_score in (None, NEVER):
        enabled, next_score = False, None
    return EntryInfo(
        name=name,
        task=task,
        schedule=schedule,
        args=tuple(args or ()),
        kwargs=dict(kwargs or {}),
        options=dict(options or {}),
        enabled=enabled,
        last_fired=instant(last),
        next_fire=instant(next_score),
        source=source,
        version=None if version is None else int(float(version)),
    )


def _config_info(name: str, spec: Any, state: Any, score: Any) -> EntryInfo:
    if isinstance(spec, Mapping):
        try:
            spec = config_spec(name, spec)
        except ScheduleError:
            pass  # shown as written; the scheduler reports the entry as broken
    get = spec.get if isinstance(spec, Mapping) else lambda key, default=None: getattr(spec, key, default)
    schedule = get("schedule")
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        schedule = celery_interval(timedelta(seconds=float(schedule)))
    elif isinstance(schedule, timedelta):
        schedule = celery_interval(schedule)
    return _info(
        name, C.ENTRY_SOURCE_CONFIG, task=str(get("task")), schedule=schedule, args=get("args") or (),
        kwargs=get("kwargs"), options=get("options"), enabled=True, state=state, score=score,
    )  # fmt: skip


def _runtime_info(
    name: str,
    raw: Any,
    state: Any,
    score: Any,
    version: Any,
    store: _Store | None = None,
    schedules: dict[Any, Any] | None = None,
) -> EntryInfo | None:
    """``schedules``: schedule objects by :func:`spec_key`, shared by the entries of a page."""
    try:
        d = parse_definition(raw)
        schedule = cached_schedule(d["schedule"], schedules)
    except ScheduleError:
        return None
    if score is None and d["enabled"] and store is not None:
        score = _planned_next(store, schedule, state)
    info = _info(
        name, C.ENTRY_SOURCE_RUNTIME, task=d["task"], schedule=schedule, args=d["args"], kwargs=d["kwargs"],
        options=d["options"], enabled=d["enabled"], state=state, score=score, version=version,
    )  # fmt: skip
    if info.enabled or not d["paused"]:
        return info
    return dataclasses.replace(info, pause_note=d["paused"].get("note"), paused_until=instant(paused_until(d)))


def _planned_next(store: _Store, schedule: Any, state: Any) -> float | None:
    """The next slot of an entry the leader has not applied yet (saved or resumed since its last
    tick), planned as the leader plans it: so ``save_entry(...).next_fire`` is a time at once. A
    crontab, one-off or rrule entry gets exactly the slot the leader takes; an interval's grid
    starts where the leader first sees the entry, up to one tick later. None when it cannot be told."""
    try:
        plan = Plan(grid=grid_for(schedule, store.app.timezone), policy=C.DEFAULT_MISFIRE)
        # With no score, next_state always plans: the state's next slot (skipping what fell while the
        # entry was paused), after its last, or the first from now.
        known = load_state(state)
        planned = next_state(plan, known, None, store.backend.clock.time(), resumed=bool(known))
    except (SafeTimeError, ValueError, TypeError):
        return None
    return None if planned is None else state_next(load_state(planned[0]))


def get_entry(name: str, app: Celery | None = None) -> EntryInfo | None:
    """The entry ``name`` (a ``beat_schedule`` entry or a runtime one) with its last and next fire."""
    store = _Store(app)
    raw = store.backend.entry_definition(name)
    (state,), (score,), (version,) = store.backend.entry_rows([name])
    config = store.config_entries()
    if name in config:
        return _config_info(name, config[name], state, score)
    if raw is None:
        return None
    return _runtime_info(name, raw, state, score, version, store)


def list_entries(app: Celery | None = None, prefix: str | None = None) -> list[EntryInfo]:
    """Every entry (config ones with source "config", runtime ones "runtime"), sorted by name;
    ``prefix`` keeps the names starting with it. Runtime entries are found with HSCAN."""
    store = _Store(app)
    config = {n: s for n, s in store.config_entries().items() if prefix is None or n.startswith(prefix)}
    defs = {k: v for k, v in store.backend.entry_definitions(prefix).items() if k not in config}
    names = sorted(set(config) | set(defs))
    if not names:
        return []
    states, scores, versions = store.backend.entry_rows(names)
    out: list[EntryInfo] = []
    for name, state, score, version in zip(names, states, scores, versions, strict=True):
        if name in config:
            out.append(_config_info(name, config[name], state, score))
        else:
            info = _runtime_info(name, defs[name], state, score, version, store)
            if info is not None:
                out.append(info)
    return out


def describe_schedule(schedule: Any) -> str:
    """A one-line text of a schedule for the command line (``cron 0 9 * * * tz=Europe/Berlin``)."""
    try:
        spec = schedule_to_spec(schedule)
    except ScheduleError:
        return repr(schedule)
    kind = spec["type"]
    if kind == "interval":
        return f"every {spec['every']:g}s"
    if kind == "crontab":
        fields = " ".join(spec[f] for f in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week"))
        return f"cron {fields}" + (f" tz={spec['tz']}" if spec.get("tz") else "")
    if kind == "at":
        return f"at {spec['at']}"
    if kind == "rrule":
        return f"rrule {spec['rule']} from {spec['dtstart']}" + (f" tz={spec['tz']}" if spec.get("tz") else "")
    return f"solar {spec['event']} {spec['lat']},{spec['lon']}"


def cron_spec(expression: str, tz: str | None) -> dict[str, Any]:
    """``"0 9 * * *"`` (minute hour day-of-month month day-of-week) as a crontab schedule spec."""
    fields = expression.split()
    if len(fields) != 5:
        raise ScheduleError(f"cron {expression!r}: expected 5 fields (minute hour day-of-month month day-of-week)")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    spec = {
        "type": "crontab",
        "minute": minute,
        "hour": hour,
        "day_of_week": day_of_week,
        "day_of_month": day_of_month,
        "month_of_year": month_of_year,
        "tz": tz,
    }
    schedule_from_spec(spec)  # validates each field and the zone
    return spec
