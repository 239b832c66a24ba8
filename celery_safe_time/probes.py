"""Probes behind ``celery safe-time status --probe beat|sweep|store``: one verdict each, for Kubernetes.

- ``beat``: some beat holds the leader lease (Redis); fails when none does, or Redis is unreachable.
- ``sweep``: the oldest pending stored delay is at most ``max_lateness`` seconds past due (by the
  store's clock); fails when it is later (no sweeper is running, or it cannot keep up) or the store
  is unreachable.
- ``store``: the store answers.

The verdicts are pure functions of what was read (``beat_verdict``, ``sweep_verdict``) so they are
tested without services; the readers around them do one or two round trips and never raise.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from celery import Celery

from . import constants as C
from .checks import Check, error_text, unreachable
from .config import get_config, mask_url

logger = logging.getLogger(__name__)

PROBES = ("beat", "sweep", "store")

#: ``--max-lateness`` default: a few sweep intervals, and never under a minute (a failover pauses sweeps).
MIN_DEFAULT_LATENESS = 60.0


def default_max_lateness(sweep_interval: float) -> float:
    return max(MIN_DEFAULT_LATENESS, 3.0 * sweep_interval)


def beat_verdict(lease_ttl_ms: int | None, leader: dict[str, Any], epoch: int | None) -> Check:
    """``beat`` from the lease key's PTTL (None or <= 0: no lease) and the leader's info hash."""
    if lease_ttl_ms is None or lease_ttl_ms <= 0:
        return Check("beat", "fail", "no beat holds the leader lease", value={"epoch": epoch})
    value = {
        "host": leader.get("host"),
        "pid": leader.get("pid"),
        "epoch": leader.get("epoch", epoch),
        "lease_left_s": round(lease_ttl_ms / 1000.0, 3),
    }
    return Check(
        "beat",
        "ok",
        f"leader {value['host'] or '?'} pid {value['pid'] or '?'} epoch {value['epoch']}, "
        f"lease left {value['lease_left_s']:.1f}s",
        value=value,
    )


def sweep_verdict(now: datetime, oldest_due: datetime | None, max_lateness: float) -> Check:
    """``sweep`` from the store's now and the oldest pending row's due time."""
    lateness = max(0.0, (now - oldest_due).total_seconds()) if oldest_due is not None else 0.0
    value = {
        "lateness_seconds": round(lateness, 3),
        "oldest_due": oldest_due.isoformat() if oldest_due else None,
        "max_lateness": max_lateness,
    }
    if lateness > max_lateness:
        return Check(
            "sweep",
            "fail",
            f"the oldest due delay is {lateness:.1f}s late (limit {max_lateness:g}s): is a sweep running?",
            value=value,
        )
    detail = "nothing pending" if oldest_due is None else f"oldest due delay {lateness:.1f}s late"
    return Check("sweep", "ok", f"{detail} (limit {max_lateness:g}s)", value=value)


def probe_beat(app: Celery) -> Check:
    from .beat.backends import beat_backend

    config = get_config(app)
    backend = beat_backend(config)
    errors: tuple[type[Exception], ...] = (*backend.errors, OSError)
    try:
        view = backend.lease_view()
    except errors as exc:
        return Check(
            "beat", "fail", f"{backend.label} {backend.where().split(' ', 1)[-1]} unreachable: {error_text(exc)}"
        )
    return beat_verdict(view.ttl_ms, view.info, view.epoch)


def probe_store(app: Celery) -> Check:
    from .delays.backends import get_store

    url = mask_url(get_config(app).store_url)
    try:
        get_store(app).ping()
    except Exception as exc:  # a probe reports every failure, whatever the driver raises
        return Check("store", "fail", unreachable(url, exc))
    return Check("store", "ok", f"{url} reachable", value=url)


def probe_sweep(app: Celery, max_lateness: float | None = None) -> Check:
    from .delays.backends import get_store

    config = get_config(app)
    limit = default_max_lateness(config.sweep_interval) if max_lateness is None else max_lateness
    try:
        store = get_store(app)
        oldest = store.oldest_due(C.STATUS_PENDING)
        now = store.now()
    except Exception as exc:  # any store failure (StoreError, a driver's own) fails the probe
        return Check("sweep", "fail", unreachable(f"store {mask_url(config.store_url)}", exc))
    return sweep_verdict(now, oldest, limit)


def run_probes(app: Celery, names: list[str], *, max_lateness: float | None = None) -> list[Check]:
    """The named probes in the given order (each once). Nothing is logged: the caller shows the
    verdicts (the command prints each once, on stdout)."""
    checks: list[Check] = []
    for name in dict.fromkeys(names):
        if name == "beat":
            checks.append(probe_beat(app))
        elif name == "sweep":
            checks.append(probe_sweep(app, max_lateness))
        elif name == "store":
            checks.append(probe_store(app))
        else:
            raise ValueError(f"unknown probe {name!r}; use one of {', '.join(PROBES)}")
    return checks
