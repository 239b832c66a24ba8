"""The ``[beat]`` section of ``celery safe-time status``: the leader and each entry's last/next slot
(on the beat backend of the app: Redis or PostgreSQL). Under Django the add-on adds django-celery-beat's
rows (:func:`celery_safe_time.contrib.django.status.describe_beat_with_django`)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from celery import Celery

from .. import constants as C
from ..clock import UTC
from ..config import get_config, mask_url
from .backends import BeatBackend, beat_backend
from .shards import incumbent
from .state import load_state


def describe_beat(app: Celery) -> dict[str, Any]:
    """``celery safe-time status`` section: the leader and per-entry last/next slot."""
    config = get_config(app)
    backend = beat_backend(config)
    try:
        view = backend.lease_view()
        info, ttl_ms, epoch = view.info, view.ttl_ms, view.epoch
        head = backend.head(C.BEAT_STATUS_ENTRIES)
        total = backend.due_count()
        names = [name for name, _ in head]
        states, _ = backend.read_states(names)
        # from the indexes (HLEN, ZCARD, ZCOUNT; COUNT on PostgreSQL): never a read of every entry
        counts = backend.entry_counts(backend.clock.time() + C.BEAT_LIST_SOON)
        shards = describe_shards(backend) if config.beat_shards > 1 else None
    except backend.errors as exc:
        return {"error": f"{backend.where()} unreachable: {exc}"}
    entries = [
        {"entry": name, "last_slot": _iso(load_state(raw).get("last")), "next_slot": _iso(float(score))}
        for (name, score), raw in zip(head, states, strict=False)
    ]
    return {
        "leader": {
            "host": info.get("host"),
            "pid": info.get("pid"),
            "epoch": info.get("epoch"),
            "lease_left_s": round(ttl_ms / 1000.0, 1) if ttl_ms and ttl_ms > 0 else None,
            # how long this beat has led (its "since" is Redis TIME when it took the lease)
            "lease_age_s": _age(info.get("since"), view.now),
        }
        if info
        else "none (no beat holds the lease)",
        "epoch": epoch,
        "lease_s": config.beat_lease,
        **({"redis": mask_url(config.redis_url)} if backend.name == C.COORDINATION_REDIS else {}),
        "backend": backend.where(),
        "entries_total": total,
        "entries_counts": {
            "config": len(app.conf.beat_schedule or {}),
            "runtime": counts.definitions,
            "scheduled": counts.scheduled,
            "due_soon": counts.due_soon,
            "soon_s": C.BEAT_LIST_SOON,
        },
        "entries": entries,
        "invalid_entries": _invalid(app, counts.definitions),
        **({} if shards is None else shards),
    }


def shard_rows(backend: BeatBackend) -> list[dict[str, Any]]:
    """Each shard's lease holder, epoch, entries scheduled, entries due now and lag (how late its oldest
    due entry is: a holder whose tick stalls shows as a growing lag); shard 0 alone with one shard.
    A few round trips per shard (the lease, then the due set's size, count and head)."""
    config = backend.config
    rows = []
    for shard in range(config.beat_shards):
        view = (backend if shard == 0 else backend.for_shard(shard)).shard_view()
        info = view.lease.info if view.lease.ttl_ms and view.lease.ttl_ms > 0 else {}
        rows.append(
            {
                "shard": shard,
                "host": info.get("host"),
                "pid": info.get("pid"),
                "epoch": info.get("epoch", view.lease.epoch),
                "lease_left_s": round(view.lease.ttl_ms / 1000.0, 1) if info and view.lease.ttl_ms else None,
                "scheduled": view.scheduled,
                "due_now": view.due_now,
                "lag_s": round(max(0.0, view.lease.now - view.oldest_due), 1) if view.oldest_due is not None else 0.0,
            }
        )
    return rows


def beat_rows(backend: BeatBackend) -> list[dict[str, Any]]:
    """The live beats of sharded firing (their heartbeats within ``BEAT_SHARD_HEARTBEAT_LEASES`` of a
    lease): shards held, their ``safe_time_beat_shards`` and fingerprint, and whether it is the K in force
    (the first-started live beat's: a beat with another K takes no shard)."""
    config = backend.config
    now = backend.clock.time()
    window = config.beat_lease * C.BEAT_SHARD_HEARTBEAT_LEASES
    pulses = {m: p for m, p in backend.beats_seen().items() if p.seen >= now - window}
    first = incumbent(pulses)
    return [
        {
            "beat": member[:8],
            "held": pulse.held,
            "shards_setting": pulse.shards,
            "fingerprint": pulse.fingerprint,
            "up_s": round(max(0.0, now - pulse.since), 1),
            "fires": first is not None and pulse.shards == first[1].shards,
        }
        for member, pulse in sorted(pulses.items(), key=lambda item: (item[1].since, item[0]))
    ]


def describe_shards(backend: BeatBackend) -> dict[str, Any]:
    """The sharded part of the ``[beat]`` section: every shard (:func:`shard_rows`) and the live beats
    (:func:`beat_rows`)."""
    return {"shards": shard_rows(backend), "beats": beat_rows(backend)}


def _invalid(app: Celery, runtime: int) -> dict[str, str] | str:
    """The entries the leader disables, with why (as ``safe-time check`` names them); with more than
    ``BEAT_STATUS_CHECK_MAX`` runtime entries, where to page through them instead (checking each one
    is a read of every definition)."""
    from .entry_pages import invalid_entries

    if runtime > C.BEAT_STATUS_CHECK_MAX:
        return (
            f"not checked here: {runtime} runtime entries (more than {C.BEAT_STATUS_CHECK_MAX}); "
            "`celery safe-time beat list --state invalid` pages through them"
        )
    try:
        problems = invalid_entries(app)
    except Exception as exc:  # a section that cannot be read says so; the others still show
        return f"unreadable: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return problems


def _age(since: Any, now: float) -> float | None:
    try:
        return round(max(0.0, now - float(since)), 1)
    except (TypeError, ValueError):
        return None


def _iso(ts: float | None) -> str | None:
    # a one-off that fired has no next slot: its score is +inf
    if ts is None or not math.isfinite(float(ts)):
        return None
    return datetime.fromtimestamp(float(ts), UTC).isoformat()
