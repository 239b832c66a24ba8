"""Checks and pages over the stored beat entries, without a leader: which entries the leader would
disable (``safe-time check``, ``status``) and the pages and counts of ``beat list``, ``status`` and the
admin overview, read through the beat backend's name index and counts instead of every definition."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry

from .. import constants as C
from .definitions import build_entry, parse_definition, spec_key
from .entries import EntryInfo, _config_info, _runtime_info, _Store
from .policies import config_spec
from .slots import entry_plan

__all__ = ["ENTRY_STATES", "EntriesPage", "count_entries", "invalid_entries", "merge_pages", "page_entries"]


@dataclasses.dataclass(frozen=True)
class _PlanApp:
    """What :func:`entry_plan` reads of an app, with every task taken as registered."""

    timezone: Any
    tasks: Any = dataclasses.field(default_factory=lambda: _EveryTask())


class _EveryTask:
    """``app.tasks`` for a process that need not know the worker's tasks (a web server): holds all."""

    def __contains__(self, name: object) -> bool:
        return True


def invalid_entries(app: Celery | None = None, *, tasks: bool = True) -> dict[str, str]:
    """Entry name -> why the leader disables it, for the ``beat_schedule`` entries and the runtime ones,
    checked as ``SafeScheduler`` checks them (its options, its task registered in ``app``, its
    schedule), without a leader: ``safe-time check`` names them. ``tasks=False`` leaves out the task
    check, for a process that does not import the worker's tasks. Reads every runtime definition:
    :func:`page_entries` checks a page of them."""
    store = _Store(app)
    config_entries = store.config_entries()
    plan_app = _plan_app(store, tasks)
    problems = {name: _config_problem(store, name, spec, plan_app) for name, spec in config_entries.items()}
    for name, raw in store.backend.entry_definitions(None).items():
        if name not in config_entries:
            problems[name] = _runtime_problem(store, name, raw, plan_app)
    return {name: problem for name, problem in problems.items() if problem is not None}


def _plan_app(store: _Store, tasks: bool) -> Any:
    return store.app if tasks else _PlanApp(store.app.timezone)


def _config_problem(store: _Store, name: str, spec: Any, plan_app: Any) -> str | None:
    try:
        entry = ScheduleEntry(**dict(config_spec(name, spec), name=name, app=store.app))
        entry_plan(entry, store.config, plan_app)
    except Exception as exc:  # the leader disables any entry it cannot build, whatever the error
        return f"invalid entry: {exc.__class__.__name__}: {exc}"
    return None


@dataclasses.dataclass
class _Checked:
    """What the entries of one page share: schedule objects by :func:`spec_key`, and the (schedule,
    task, policies) found valid; thousands of tenants share a handful of schedules, and building a
    crontab is the costly part of checking one."""

    schedules: dict[Any, Any] = dataclasses.field(default_factory=dict)
    valid: set[Any] = dataclasses.field(default_factory=set)


def _runtime_problem(store: _Store, name: str, raw: Any, plan_app: Any, checked: _Checked | None = None) -> str | None:
    try:
        d = parse_definition(raw)
        key = None
        if checked is not None:
            policies = tuple(sorted((k, repr(v)) for k, v in d["options"].items() if k.startswith("safe_")))
            key = (spec_key(d["schedule"]), d["task"], policies)
            if key in checked.valid:
                return None
        entry = build_entry(name, d, store.app, None if checked is None else checked.schedules)
        entry_plan(entry, store.config, plan_app)
        if checked is not None:
            checked.valid.add(key)
    except Exception as exc:  # as _config_problem
        return f"invalid runtime entry: {exc}"
    return None


# --- pages and counts (``beat list``, ``status``, the admin overview) ---------------------------------

#: ``page_entries``'s state filter: the STATE column of ``beat list`` (enabled entries are "active"),
#: and "due-soon" (in the due set, next fire within ``soon`` seconds).
ENTRY_STATES = ("active", "paused", "invalid", "due-soon")


@dataclasses.dataclass(frozen=True)
class EntriesPage:
    """One page of :func:`page_entries`."""

    #: the entries, sorted by name (code point order)
    entries: list[EntryInfo]
    #: why the leader disables them, for the entries of the page it does (an unreadable runtime
    #: definition is here without being in ``entries``)
    invalid: dict[str, str]
    #: where the next page starts (pass it as ``after``); None when no entry is left after this page
    after: str | None
    #: runtime definitions read for this page (a state filter reads more than it keeps)
    scanned: int


def page_entries(
    app: Celery | None = None,
    *,
    after: str | None = None,
    limit: int = C.BEAT_LIST_LIMIT,
    prefix: str | None = None,
    state: str | None = None,
    soon: float = C.BEAT_LIST_SOON,
    tasks: bool = True,
    scan: int = C.BEAT_LIST_SCAN,
) -> EntriesPage:
    """Up to ``limit`` entries (config and runtime ones, as :func:`list_entries` shows them) whose name
    comes after ``after``, starts with ``prefix`` and, with ``state`` (one of :data:`ENTRY_STATES`),
    is in that state. Reads the backend's name index a page at a time, never every entry: a state
    filter reads at most about ``scan`` runtime definitions per call and may answer fewer than
    ``limit`` entries with ``after`` set (go on from there). ``tasks=False``: as :func:`invalid_entries`."""
    if state is not None and state not in ENTRY_STATES:
        raise ValueError(f"state {state!r}: expected one of {', '.join(ENTRY_STATES)}")
    store = _Store(app)
    config_all = store.config_entries()
    config = sorted(n for n in config_all if (not prefix or n.startswith(prefix)) and (after is None or n > after))
    plan_app = _plan_app(store, tasks)
    checked = _Checked()
    if state == "due-soon":
        return _due_soon_page(store, config_all, after, limit, prefix, soon, plan_app, checked)
    out: list[EntryInfo] = []
    invalid: dict[str, str] = {}
    scanned = 0
    cursor = after
    while True:
        room = limit - len(out)
        # One name more than the page needs tells whether another page follows. A filter keeps only
        # some: it reads chunks of at least 1,000, within what is left of its scan budget.
        chunk = room + 1 if state is None else max(1, min(max(room + 1, 1000), scan - scanned))
        read = store.backend.entry_page(cursor, chunk, prefix) if chunk > 0 else []
        scanned += len(read)
        full = bool(read) and len(read) >= chunk
        bound = read[-1][0] if full else None
        runtime: list[tuple[str, Any]] = [(n, raw) for n, raw in read if n not in config_all]
        # the config names up to the chunk's last runtime name (all that are left once the runtime ones end)
        names = [n for n in config if (cursor is None or n > cursor) and (bound is None or n <= bound)]
        candidates = sorted([(n, None) for n in names] + runtime, key=lambda item: item[0])
        rows = store.backend.entry_rows([n for n, _ in candidates]) if candidates else ([], [], [])
        for index, ((name, raw), st, score, version) in enumerate(zip(candidates, *rows, strict=True)):
            info, problem = _entry_and_problem(store, name, raw, config_all, st, score, version, plan_app, checked)
            cursor = name
            if state is None or _state_of(info, problem) == state:
                if info is not None:
                    out.append(info)
                if problem is not None:
                    invalid[name] = problem
                if len(out) >= limit:
                    last = index == len(candidates) - 1 and not full
                    return EntriesPage(out, invalid, None if last else name, scanned)
        if not full:
            return EntriesPage(out, invalid, None, scanned)
        cursor = bound
        if state is not None and scanned >= scan:
            return EntriesPage(out, invalid, cursor, scanned)


def count_entries(app: Celery | None = None, *, soon: float = C.BEAT_LIST_SOON) -> dict[str, Any]:
    """The sizes of the schedule, from the backend's indexes: ``config`` entries, ``runtime``
    definitions, ``scheduled`` (in the due set: enabled and planned), ``due_soon`` (next fire within
    ``soon`` seconds, also given as ``soon_s``)."""
    store = _Store(app)
    counts = store.backend.entry_counts(store.backend.clock.time() + soon)
    return {
        "config": len(store.config_entries()),
        "runtime": counts.definitions,
        "scheduled": counts.scheduled,
        "due_soon": counts.due_soon,
        "soon_s": soon,
    }


def merge_pages(
    first: Sequence[tuple[str, Any]], first_after: str | None, second: Sequence[tuple[str, Any]], limit: int
) -> tuple[list[tuple[str, Any]], str | None]:
    """Two pages of (name, item) in name order from two sources (runtime and config entries; the
    django-celery-beat rows), ``second`` a full page when it holds ``limit``, as one page and its
    cursor: the page ends where the first source that may go on ends (past it, the other source's
    names could skip some of its own)."""
    merged = sorted([*first, *second], key=lambda pair: pair[0])
    ends = [end for end in (first_after, second[-1][0] if len(second) >= limit else None) if end is not None]
    bound = min(ends) if ends else None
    merged = [pair for pair in merged if bound is None or pair[0] <= bound]
    more = bound is not None
    if len(merged) > limit:
        merged, more = merged[:limit], True
    return merged, (merged[-1][0] if merged else bound) if more else None


def _entry_and_problem(
    store: _Store,
    name: str,
    raw: Any,
    config_all: Mapping[str, Any],
    state: Any,
    score: Any,
    version: Any,
    plan_app: Any,
    checked: _Checked,
) -> tuple[EntryInfo | None, str | None]:
    if name in config_all:
        spec = config_all[name]
        return _config_info(name, spec, state, score), _config_problem(store, name, spec, plan_app)
    problem = _runtime_problem(store, name, raw, plan_app, checked)
    return _runtime_info(name, raw, state, score, version, store, checked.schedules), problem


def _state_of(info: EntryInfo | None, problem: str | None) -> str:
    if problem is not None or info is None:
        return "invalid"
    return "active" if info.enabled else "paused"


def _due_soon_page(
    store: _Store,
    config_all: Mapping[str, Any],
    after: str | None,
    limit: int,
    prefix: str | None,
    soon: float,
    plan_app: Any,
    checked: _Checked,
) -> EntriesPage:
    """The entries of the due set whose next fire is within ``soon`` seconds, in name order: read
    from the due set by score (at most ``BEAT_LIST_DUE_MAX``), never from the definitions."""
    due = store.backend.read_due(store.backend.clock.time() + soon, C.BEAT_LIST_DUE_MAX).due
    names = sorted(n for n, _ in due if (not prefix or n.startswith(prefix)) and (after is None or n > after))
    page, rest = names[:limit], names[limit:]
    runtime = [n for n in page if n not in config_all]
    raw_of = dict(zip(runtime, store.backend.definitions(runtime), strict=True))
    states, scores, versions = store.backend.entry_rows(page) if page else ([], [], [])
    out: list[EntryInfo] = []
    for name, st, score, version in zip(page, states, scores, versions, strict=True):
        raw = raw_of.get(name)
        if name not in config_all and raw is None:
            continue  # a name the due set still holds, deleted meanwhile
        info, problem = _entry_and_problem(store, name, raw, config_all, st, score, version, plan_app, checked)
        if info is not None and problem is None:
            out.append(info)
    return EntriesPage(out, {}, page[-1] if rest else None, len(page))
