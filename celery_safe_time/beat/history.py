"""Run history and change audit per beat entry.

**History.** The last ``safe_time_beat_history_size`` runs of each entry (50 by default): its slot, when
it was published, the task id, by which beat (epoch, host), and its outcome. Beat writes the published part
in the dispatch guard's round trip (the task id is chosen before the guard, then given to the publish); the
worker that runs the task fills in the outcome (succeeded, failed, retried, revoked, when it finished, how
long it ran) from the ``safe_time_entry`` and ``safe_time_slot`` headers, and never fails a task for it
(an error is logged). A slot that was claimed but could not be published shows ``not published``.

**Audit.** Every change to a runtime entry (``save_entry``, ``delete_entry``, pause, resume, a one-off
disabling itself, ``run_now``, ``backfill``) appends a record: when, who (``changed_by``, by default
``user@host pid N``), the action, and the old and new definitions (JSON), written atomically with the
change. Kept per entry, the newest ``safe_time_beat_audit_size`` (50 by default). django-celery-beat's rows
are audited by ``celery_safe_time.contrib.django.audit``, after their change is committed.

Records are JSON, stored by the app's beat backend (Redis: a hash and a sorted set per entry for the
history, a list for the audit; PostgreSQL: ``safe_time_beat_history`` and ``safe_time_beat_audit``).
Read them with :func:`entry_history` and :func:`entry_audit`.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Celery, current_app
from dateutil.parser import isoparse

from .. import constants as C
from ..config import SafeTimeConfig, get_config
from ..messages.requeue import message_header
from .backends import BeatBackend, SlotWrite, beat_backend
from .state import instant, load_state, with_definitions

__all__ = [
    "AuditRecord",
    "RunRecord",
    "audit_meta",
    "cached_backend",
    "default_changed_by",
    "entry_audit",
    "entry_history",
    "published_record",
    "record_audit",
    "stamp_writes",
]

logger = logging.getLogger(__name__)

#: Celery task states and the outcome a history record shows for them.
_OUTCOMES = {
    "SUCCESS": C.RUN_SUCCEEDED,
    "FAILURE": C.RUN_FAILED,
    "RETRY": C.RUN_RETRIED,
    "REVOKED": C.RUN_REVOKED,
    "IGNORED": C.RUN_SUCCEEDED,
    "REJECTED": C.RUN_FAILED,
}


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One run of a beat entry (times are aware UTC datetimes, durations seconds)."""

    entry: str
    slot: datetime
    published_at: datetime | None
    task_id: str | None
    #: ``published`` (no outcome reported yet: queued or running), ``succeeded``, ``failed``,
    #: ``retried``, ``revoked`` or ``not published``
    outcome: str
    #: published at minus the slot (a jittered entry's jitter included)
    lateness: float | None
    epoch: int | None
    #: the beat (or backfill) host that published it
    host: str | None
    #: ``beat``, ``run-now`` or ``backfill``
    via: str
    finished_at: datetime | None = None
    runtime: float | None = None
    worker: str | None = None
    retries: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("slot", "published_at", "finished_at"):
            out[key] = None if out[key] is None else out[key].isoformat()
        return out


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    """One change of a beat entry: ``old`` and ``new`` are the definitions (None where absent)."""

    entry: str
    at: datetime
    changed_by: str
    #: ``create``, ``update``, ``delete``, ``pause``, ``resume``, ``enable``, ``disable``, ``run-now``
    #: or ``backfill``
    action: str
    old: dict[str, Any] | None
    new: dict[str, Any] | None
    version: int | None = None
    #: what a run-now or backfill asked for (slots, range)
    detail: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["at"] = self.at.isoformat()
        return out


# --- who changed it -----------------------------------------------------------------------------


def default_changed_by() -> str:
    """``user@host pid N``: the OS user, this host and process (the CLI passes the same)."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name (a container without passwd entry)
        user = str(os.getuid()) if hasattr(os, "getuid") else "?"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def beat_changer() -> str:
    """Who a change made by the beat leader itself is by (a pause expiring, a one-off done)."""
    return f"beat {socket.gethostname()} pid {os.getpid()}"


def audit_meta(config: SafeTimeConfig, action: str, changed_by: str | None, now: float, **detail: Any) -> str | None:
    """The JSON object of an audit record without its definitions (the backend adds ``old``, ``new``
    and ``version`` where it makes the change); None when the audit is off (size 0)."""
    if not config.beat_audit_size:
        return None
    body: dict[str, Any] = {"at": now, "by": changed_by or default_changed_by(), "action": action}
    if detail:
        body["detail"] = detail
    return json.dumps(body, separators=(",", ":"), default=str)


def record_audit(
    backend: BeatBackend, name: str, action: str, changed_by: str | None, now: float, **detail: Any
) -> None:
    """Append an audit record that changes no definition (run-now, backfill)."""
    meta = audit_meta(backend.config, action, changed_by, now, **detail)
    if meta is not None:
        backend.audit_append(name, with_definitions(meta, None, None, None))


# --- the beat side ------------------------------------------------------------------------------


def published_record(
    slot: float, published_at: float, task_id: str, epoch: int | None, host: str, via: str = "beat"
) -> str:
    """The published part of a history record (JSON)."""
    return json.dumps(
        {"slot": slot, "at": published_at, "task_id": task_id, "epoch": epoch, "host": host, "via": via},
        separators=(",", ":"),
    )


_HOST = socket.gethostname()


def stamp_writes(
    writes: list[SlotWrite], epoch: int, now: float, size: int
) -> tuple[list[SlotWrite], dict[tuple[str, float], str]]:
    """Give each dispatch of ``writes`` a task id and its history record (when the history is on,
    ``size`` > 0); returns the writes and the task ids by (entry, slot), for the publish."""
    if not size:
        return writes, {}
    ids: dict[tuple[str, float], str] = {}
    out: list[SlotWrite] = []
    for write in writes:
        if write.slot is None:
            out.append(write)
            continue
        task_id = str(uuid.uuid4())
        ids[(write.entry, write.slot)] = task_id
        record = published_record(write.slot, now, task_id, epoch, _HOST)
        out.append(dataclasses.replace(write, history=record))
    return out, ids


def record_published(
    backend: BeatBackend, name: str, slot: float, epoch: int | None, via: str
) -> dict[tuple[str, float], str]:
    """Write the run record of a slot dispatched outside a tick's batch (run-now, a backfill, the
    database scheduler): one write of its own. Returns {(name, slot): task id} for the publish ({}
    when the history is off); a failed write is logged, never raised (the slot is fired already)."""
    if not backend.config.beat_history_size:
        return {}
    task_id = str(uuid.uuid4())
    try:
        backend.history_record(name, slot, published_record(slot, backend.clock.time(), task_id, epoch, _HOST, via))
    except Exception as exc:
        logger.warning("beat: the run history of entry %r slot %s could not be written: %s", name, slot, exc)
    return {(name, slot): task_id}


def not_published(backend: BeatBackend, name: str, slot: float, now: float, error: BaseException | str) -> None:
    """Mark a claimed slot whose publish failed (logged by the caller); never raises. ``error`` is the
    exception, or what the broker said when it refused the one message (SQS, in a batch)."""
    said = error if isinstance(error, str) else f"{error.__class__.__name__}: {error}"
    _mark(backend, name, slot, {"outcome": C.RUN_NOT_PUBLISHED, "finished": now, "error": said})


def dropped(backend: BeatBackend, name: str, slot: float, now: float) -> None:
    """Mark a claimed slot that the entry's overlap policy dropped (logged by the gate); never raises."""
    _mark(backend, name, slot, {"outcome": C.RUN_DROPPED, "finished": now})


def _mark(backend: BeatBackend, name: str, slot: float, outcome: dict[str, Any]) -> None:
    if not backend.config.beat_history_size:
        return
    try:
        backend.history_outcome(name, slot, json.dumps(outcome, separators=(",", ":")))
    except Exception as exc:
        logger.warning("beat: the run history of entry %r slot %s could not be written: %s", name, slot, exc)


# --- the worker side ----------------------------------------------------------------------------

_backends: weakref.WeakKeyDictionary[Celery, BeatBackend] = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()
#: task id -> when it started (``time.monotonic``), for its runtime; popped when it finishes
_started: dict[str, float] = {}


def cached_backend(app: Celery) -> BeatBackend:
    """The app's beat backend, made once per app (a PostgreSQL one checks its tables once)."""
    with _backends_lock:
        backend = _backends.get(app)
        if backend is None:
            backend = _backends[app] = beat_backend(get_config(app))
        return backend


def _slot_of(request: Any) -> tuple[str, float] | None:
    entry = message_header(request, C.HEADER_ENTRY)
    slot = message_header(request, C.HEADER_SLOT)
    if not entry or not slot:
        return None
    return str(entry), isoparse(str(slot)).timestamp()


def report_outcome(app: Celery, request: Any, state: str, task_id: str | None) -> None:
    """Write the outcome of a beat-published task into its entry's history; never raises."""
    started = _started.pop(task_id, None) if task_id else None
    try:
        found = _slot_of(request)
        if found is None or not get_config(app).beat_history_size:
            return
        backend = cached_backend(app)
        entry, slot = found
        now = time.time()
        label = _OUTCOMES.get(state, state.lower())
        admission = getattr(request, C.REQUEST_ADMISSION_ATTR, None)
        if state in ("IGNORED", "SUCCESS") and admission in (C.ADMISSION_DUPLICATE, C.ADMISSION_SKIPPED):
            # A gate dropped this run (a copy of one that runs or ran, or skipped by its rule): its
            # body did not run here.
            label = C.RUN_DROPPED
        outcome: dict[str, Any] = {"outcome": label, "finished": now}
        if started is not None:
            outcome["runtime"] = round(time.monotonic() - started, 6)
        outcome["worker"] = getattr(request, "hostname", None) or _HOST
        retries = getattr(request, "retries", None)
        if isinstance(retries, int):
            outcome["retries"] = retries
        backend.history_outcome(entry, slot, json.dumps(outcome, separators=(",", ":")))
    except Exception as exc:
        logger.warning("the run history of task %s could not be written (the task is not affected): %s", task_id, exc)


def on_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    try:
        if task_id and message_header(task.request, C.HEADER_ENTRY):
            _started[task_id] = time.monotonic()
    except Exception:  # never in the way of a task
        pass


def on_postrun(task_id: str | None = None, task: Any = None, state: str | None = None, **_: Any) -> None:
    try:
        app = task._get_app()
        request = task.request
    except Exception:
        _started.pop(task_id or "", None)
        return
    report_outcome(app, request, state or "", task_id)


def on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    try:
        app = sender._get_app() if sender is not None else current_app._get_current_object()
    except Exception:
        return
    report_outcome(app, request, "REVOKED", getattr(request, "id", None))


# Connected by ``celery_safe_time.install`` (imported with the package): every worker reports.


# --- the read side ------------------------------------------------------------------------------


def run_record(name: str, published: Any, outcome: Any) -> RunRecord | None:
    """A stored (published, outcome) pair as a :class:`RunRecord`; None when it is unreadable."""
    p, o = load_state(published), load_state(outcome)
    slot = instant(p.get("slot"))
    if slot is None:
        return None
    at = p.get("at")
    lateness = round(float(at) - float(p["slot"]), 3) if isinstance(at, (int, float)) else None
    runtime = o.get("runtime")
    retries = o.get("retries")
    return RunRecord(
        entry=name,
        slot=slot,
        published_at=instant(at),
        task_id=p.get("task_id"),
        outcome=str(o.get("outcome") or C.RUN_PUBLISHED),
        lateness=lateness,
        epoch=p.get("epoch") if isinstance(p.get("epoch"), int) else None,
        host=p.get("host"),
        via=str(p.get("via") or "beat"),
        finished_at=instant(o.get("finished")),
        runtime=float(runtime) if isinstance(runtime, (int, float)) else None,
        worker=o.get("worker"),
        retries=retries if isinstance(retries, int) else None,
    )


def audit_record(name: str, raw: Any) -> AuditRecord | None:
    """A stored audit record as an :class:`AuditRecord`; None when it is unreadable."""
    d = load_state(raw)
    at = instant(d.get("at"))
    if at is None:
        return None
    old = d.get("old") if isinstance(d.get("old"), Mapping) else None
    new = d.get("new") if isinstance(d.get("new"), Mapping) else None
    action = str(d.get("action") or "?")
    if action == "save":
        action = "create" if old is None else "update"
    version = d.get("version")
    detail = d.get("detail")
    return AuditRecord(
        entry=name,
        at=at,
        changed_by=str(d.get("by") or "?"),
        action=action,
        old=dict(old) if old is not None else None,
        new=dict(new) if new is not None else None,
        version=version if isinstance(version, int) else None,
        detail=dict(detail) if isinstance(detail, Mapping) else None,
    )


def _app(app: Celery | None) -> Celery:
    return app if app is not None else current_app._get_current_object()


def entry_history(name: str, app: Celery | None = None, limit: int = C.DEFAULT_BEAT_HISTORY_SIZE) -> list[RunRecord]:
    """The last ``limit`` runs of the beat entry ``name``, newest slot first (empty when it has none
    or the history is off)."""
    records = (run_record(name, *pair) for pair in cached_backend(_app(app)).history(name, limit))
    return [record for record in records if record is not None]


def entry_audit(name: str, app: Celery | None = None, limit: int = C.DEFAULT_BEAT_AUDIT_SIZE) -> list[AuditRecord]:
    """The last ``limit`` changes of the beat entry ``name``, newest first."""
    records = (audit_record(name, raw) for raw in cached_backend(_app(app)).audit(name, limit))
    return [record for record in records if record is not None]
