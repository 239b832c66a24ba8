"""The overlap policy of a beat entry: what a slot does while a run of the entry is queued or running.

``options={"safe_time_overlap": policy}`` (``overlap=`` in ``save_entry`` and ``beat_schedule``):

- ``allow`` (default): every slot is published, runs may overlap (Celery's own behaviour);
- ``skip``: a slot is dropped while a run of the entry is queued or running;
- ``buffer_one``: a slot is published while nothing is queued; it waits behind the running run;
  further slots are dropped while one waits;
- ``buffer_all``: every slot is published; the runs go one at a time, in slot order (each waits
  for the run published before it to start, then for the lease);
- ``cancel_other``: the running run is terminated (``revoke(terminate=True)``, SIGTERM: raised as
  :class:`~celery_safe_time.exceptions.RunCancelled` in it), a queued one is revoked, and the new
  run starts once the old one has released the lease.

What is known, and where: "running" is the entry's run lease (an overlap lock, held by the worker
while the body runs, renewed by the lock watchdog, expired ``ttl`` after a ``kill -9``:
:mod:`..locks.entry_runs`); "queued" is a marker on the same lock backend (a unique key holding the
queued run's task id) that beat takes when it publishes, the waiting run refreshes while it waits and
the run drops when it starts. Both expire, so nothing blocks an entry longer than its ttl.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Mapping
from typing import Any, Literal

import redis
from celery import Celery
from celery.utils import uuid

from .. import constants as C
from ..clock import to_datetime
from ..config import SafeTimeConfig
from ..locks.backends import LockBackend, get_lock_backend
from ..locks.entry_runs import entry_key, last_key, retry_after, run_key
from .policies import OPTION_OVERLAP, OPTION_OVERLAP_TTL, beat_slot_dropped, overlap_option, seconds_option

logger = logging.getLogger(__name__)

__all__ = ["OverlapGate", "Verdict", "beat_slot_dropped", "decide", "overlap_of", "slot_options"]

Verdict = Literal["publish", "drop", "cancel"]

_HOST = socket.gethostname()


def decide(policy: str, *, running: bool, queued: bool) -> Verdict:
    """What a slot of an entry with overlap ``policy`` does, given whether a run of it is running
    (its lease is held) and whether one is queued (published, not started): ``publish``, ``drop``,
    or ``cancel`` (terminate the running one, revoke the queued one, then publish)."""
    if policy == "skip":
        return "drop" if running or queued else "publish"
    if policy == "buffer_one":
        return "drop" if queued else "publish"
    if policy == "cancel_other":
        return "cancel" if running or queued else "publish"
    return "publish"  # allow, buffer_all: every slot is published (buffer_all's wait on the lease)


@dataclasses.dataclass(frozen=True)
class Overlap:
    """An entry's overlap policy and the lease of one of its runs (seconds)."""

    policy: str = "allow"
    ttl: float = C.DEFAULT_LOCK_TTL


def overlap_of(options: Mapping[str, Any] | None, name: str, config: SafeTimeConfig) -> Overlap:
    """The overlap policy an entry's options set (validated: :class:`ScheduleError` names the entry)."""
    options = options or {}
    policy = options.get(OPTION_OVERLAP)
    ttl = options.get(OPTION_OVERLAP_TTL)
    return Overlap(
        policy="allow" if policy is None else overlap_option(policy, name),
        ttl=config.lock_ttl if ttl is None else seconds_option(ttl, OPTION_OVERLAP_TTL, name, zero_ok=False),
    )


def slot_options(
    options: Mapping[str, Any] | None, extra: dict[str, Any], headers: dict[str, Any], task_id: str | None
) -> dict[str, Any]:
    """The ``apply_async`` options of one slot: the entry's own less ours (``safe_time_*``), plus what
    :meth:`OverlapGate.admit` added (``extra``), the slot's ``headers`` and the ``task_id`` its run
    record names."""
    out = {k: v for k, v in (options or {}).items() if not k.startswith("safe_time_")}
    out["headers"] = {**(out.get("headers") or {}), **extra.pop("headers", {}), **headers}
    out.update(extra)
    if task_id is not None:
        out["task_id"] = task_id
    return out


class OverlapGate:
    """Beat's side: decides at dispatch, from the lock backend's lease and queued marker."""

    def __init__(self, app: Celery, config: SafeTimeConfig) -> None:
        self.app = app
        self.config = config

    def store(self) -> LockBackend:
        return get_lock_backend(self.app)

    def admit(
        self, name: str, options: Mapping[str, Any] | None, slot: float, *, task_id: str | None = None
    ) -> dict[str, Any] | None:
        """The ``apply_async`` options to add to ``name``'s ``slot`` (its task id and the
        ``safe_time_overlap`` header; nothing for ``allow``), or None: the slot is dropped (logged
        and signalled). ``task_id`` is the id the slot's run record names (None: a new one). Never
        raises for the lock backend: unreachable, the slot is published with the header, and the
        worker's lease still keeps the runs apart."""
        overlap = overlap_of(options, name, self.config)
        if overlap.policy == "allow":
            return {}
        task_id = task_id or uuid()
        extra: dict[str, Any] = {
            "task_id": task_id,
            "headers": {C.HEADER_OVERLAP: {"entry": name, "policy": overlap.policy, "ttl": overlap.ttl}},
        }
        try:
            if overlap.policy == "buffer_all":
                after = self._chain(name, overlap, task_id)
                if after is not None:
                    extra["headers"][C.HEADER_OVERLAP]["after"] = after
                return extra
            reason = self._claim(name, overlap, task_id)
        except (redis.RedisError, OSError) as exc:
            logger.warning(
                "beat: entry %r: overlap %s could not read its runs (%s); publishing, the worker's lease "
                "keeps the runs apart",
                name,
                overlap.policy,
                exc,
            )
            return extra
        if reason is None:
            return extra
        when = to_datetime(slot)
        logger.info(
            "beat: entry %r slot %s dropped (overlap %s: a run is %s)", name, when.isoformat(), overlap.policy, reason
        )
        beat_slot_dropped.send(sender=self, entry=name, slot=when, policy=overlap.policy, reason=reason)
        return None

    def unpublished(self, name: str, options: Mapping[str, Any]) -> None:
        """A slot :meth:`admit` let through could not be published: free the marker it took for it
        (else it would count as queued until it expires)."""
        spec = (options.get("headers") or {}).get(C.HEADER_OVERLAP)
        task_id = options.get("task_id")
        if not isinstance(spec, Mapping) or not isinstance(task_id, str):
            return
        store = self.store()
        marker = run_key(name, task_id) if spec.get("policy") == "buffer_all" else entry_key(name)
        try:
            store.unique_release(marker, task_id)
        except (redis.RedisError, OSError) as exc:
            logger.warning(
                "beat: entry %r: could not free the queued marker of %s (it expires): %s", name, task_id, exc
            )

    def _claim(self, name: str, overlap: Overlap, task_id: str) -> str | None:
        """Take the queued marker for ``task_id`` as the policy says; None: publish, else why not."""
        store = self.store()
        key = entry_key(name)
        # The marker lives as long as a run may wait to be picked up; a waiting run refreshes it.
        marker_ttl = overlap.ttl + retry_after(overlap.ttl)
        if overlap.policy == "cancel_other":
            self._cancel(store, name, key, task_id, marker_ttl)
            return None
        # The marker first, then the lease: a queued run moves from the marker to the lease (it takes
        # the lease, then drops the marker), so it is seen in one or the other.
        claim = store.unique_acquire(key, task_id, marker_ttl, "queued", stored=False, host=_HOST)
        queued = claim.status == "held"
        running = False
        if not queued and overlap.policy == "skip":
            running = store.holder_record(key) is not None
        verdict = decide(overlap.policy, running=running, queued=queued)
        if verdict == "publish":
            return None
        if not queued:
            store.unique_release(key, task_id)
        return "queued" if queued else "running"

    def _chain(self, name: str, overlap: Overlap, task_id: str) -> str | None:
        """``buffer_all``: queue ``task_id`` behind the last run published; returns that run's id."""
        store = self.store()
        last = last_key(name)
        info = store.unique_info(last, time.time())
        before = info.task_id if info is not None else None
        marker_ttl = overlap.ttl + retry_after(overlap.ttl)
        store.unique_acquire(run_key(name, task_id), task_id, marker_ttl, "queued", stored=False, host=_HOST)
        store.unique_acquire(
            last, task_id, C.OVERLAP_LAST_TTL, "queued", stored=False, host=_HOST, gone=before, own=False
        )
        return before

    def _cancel(self, store: LockBackend, name: str, key: str, task_id: str, marker_ttl: float) -> None:
        """``cancel_other``: terminate the running run, revoke a queued one, and queue ``task_id``."""
        record = store.holder_record(key)
        running = record[1] if record is not None else None
        claim = store.unique_acquire(key, task_id, marker_ttl, "queued", stored=False, host=_HOST)
        queued = claim.holder if claim.status == "held" else None
        if queued is not None:
            store.unique_acquire(key, task_id, marker_ttl, "queued", stored=False, host=_HOST, gone=queued)
        if decide("cancel_other", running=running is not None, queued=queued is not None) != "cancel":
            return
        try:
            if queued is not None:
                self.app.control.revoke(queued)
                logger.info("beat: entry %r: revoked its queued run %s (overlap cancel_other)", name, queued)
            if running is not None:
                self.app.control.revoke(running, terminate=True, signal=C.OVERLAP_CANCEL_SIGNAL)
                logger.info(
                    "beat: entry %r: terminating its running run %s (overlap cancel_other); the new run %s "
                    "starts once it released the lease",
                    name,
                    running,
                    task_id,
                )
        except Exception as exc:
            # The new run still waits for the lease: never two at once, only a later start.
            logger.warning("beat: entry %r: could not revoke its earlier run (%s); the new run waits", name, exc)
