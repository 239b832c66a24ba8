"""Health checks behind ``celery safe-time check``, the schedulers' startup checks, and the verdicts
of ``celery safe-time status --probe beat|sweep|store``.

Each check and probe returns a :class:`~celery_safe_time.health.Check`; nothing here prints, so the
CLI can render a table or JSON and the beat can log.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import datetime
from importlib.metadata import version
from typing import Any

from celery import Celery

from . import constants as C
from .clock import local_time
from .config import SafeTimeConfig, first_broker_url, get_config, mask_url, setting_warnings
from .exceptions import SafeTimeError
from .health import STATUS_ORDER, Check, Status, check_redis, clock_skew, error_text

logger = logging.getLogger(__name__)

#: Seconds ``safe-time check`` waits for the broker to accept a connection (the app's own
#: ``broker_connection_timeout`` wins when set lower or higher; this bounds a Redis broker's socket).
BROKER_CHECK_TIMEOUT = 5.0


def check_coordination(config: SafeTimeConfig) -> list[Check]:
    """PostgreSQL coordination (``safe_time_coordination_url``): reachable, the beat tables there (made
    if missing, as a beat would), and this host's clock against the database's (the beat's authority)."""
    from .beat.backends import beat_backend

    backend = beat_backend(config)
    where = backend.where()
    try:
        backend.ensure_tables()
        offset = backend.clock.sync()
    except backend.errors as exc:
        return [Check("coordination", "fail", f"{where} unreachable: {exc.__class__.__name__}: {error_text(exc)}")]
    return [
        Check(
            "coordination",
            "ok",
            f"{where} reachable (rtt {offset.rtt * 1000:.1f} ms); beat tables present",
            value=offset.rtt,
        ),
        clock_skew(
            "clock_skew_coordination",
            "the coordination database's clock",
            offset.offset,
            offset.uncertainty,
            config.max_clock_skew,
        ),
    ]


_BROKER_NAMES = {
    C.BROKER_AMQP: "RabbitMQ (AMQP)",
    C.BROKER_REDIS: "Redis",
    C.BROKER_SQS: "SQS",
    C.BROKER_OTHER: "other",
}


def check_broker(config: SafeTimeConfig, app: Celery | None = None) -> Check:
    """Which broker the app publishes to and the delay threshold that follows from it, with why; with
    ``app``, whether the broker accepts a connection (its URL, credentials and virtual host)."""
    parts = [f"{config.broker_kind}: {_BROKER_NAMES.get(config.broker_kind, config.broker_kind)}"]
    if config.visibility_timeout is not None:
        parts.append(f"visibility_timeout {config.visibility_timeout:g} s")
    if config.broker_consumer_timeout is not None:
        parts.append(f"consumer_timeout {config.broker_consumer_timeout:g} s")
    detail = (
        f"{', '.join(parts)}; delay threshold {config.delay_threshold:g} s ({config.delay_threshold_reason}); "
        f"sweep look-ahead {config.sweep_lookahead:g} s"
    )
    value = {
        "kind": config.broker_kind,
        "visibility_timeout": config.visibility_timeout,
        "consumer_timeout": config.broker_consumer_timeout,
        "delay_threshold": config.delay_threshold,
        "delay_threshold_reason": config.delay_threshold_reason,
        "sweep_lookahead": config.sweep_lookahead,
    }
    if app is None:
        return Check("broker", "ok", detail, value=value)
    where, rtt, error = broker_connection(app)
    value["url"] = where
    if error is not None:
        return Check("broker", "fail", f"{where} unreachable: {error}; {detail}", value=value)
    value["connect_seconds"] = rtt
    return Check("broker", "ok", f"{where} reachable (connected in {rtt * 1000:.0f} ms); {detail}", value=value)


def broker_connection(app: Celery) -> tuple[str, float, str | None]:
    """Connect to the app's broker once, as a worker would (its URL, ``broker_use_ssl``, transport
    options), without retrying: ``(masked url, seconds to connect, None)`` or ``(..., error)``."""
    transport_options: dict[str, Any] = {}
    if config_broker_scheme(app) in C.REDIS_BROKER_SCHEMES:
        # kombu's Redis transport has no connect timeout of its own: a host that drops packets would
        # hold the check for minutes.
        own = dict(app.conf.broker_transport_options or {})
        transport_options = {
            key: BROKER_CHECK_TIMEOUT for key in ("socket_connect_timeout", "socket_timeout") if key not in own
        }
    connection = app.connection_for_write(connect_timeout=BROKER_CHECK_TIMEOUT, transport_options=transport_options)
    where = mask_url(connection.as_uri(include_password=True))
    started = time.monotonic()
    try:
        # max_retries=0: one attempt (kombu retries otherwise, sleeping between attempts).
        connection.ensure_connection(max_retries=0)
    except Exception as exc:  # any transport's error is the verdict, never a crash of the check
        return where, 0.0, f"{exc.__class__.__name__}: {error_text(exc)}"
    finally:
        connection.release()
    return where, time.monotonic() - started, None


def config_broker_scheme(app: Celery) -> str:
    """The scheme of the app's (first) broker URL, lowercased and without its ``+driver`` part."""
    url = first_broker_url(app)
    return url.split("://", 1)[0].split("+")[0].lower() if "://" in url else ""


def unreachable(url: str, exc: BaseException) -> str:
    """A failed row's detail: our own errors already name what and where (``store <url> unreachable:
    ...``); a driver's error gets the URL and its class in front."""
    if isinstance(exc, SafeTimeError):
        return error_text(exc)
    return f"{url} unreachable: {exc.__class__.__name__}: {error_text(exc)}"


def check_store(app: Celery, config: SafeTimeConfig) -> list[Check]:
    """Store reachability and its clock against this host."""
    from .delays.backends import get_store

    url = mask_url(config.store_url)
    try:
        store = get_store(app)
        before = local_time()
        db_now = store.now()
        after = local_time()
    except Exception as exc:  # driver errors must not crash the probe
        return [Check("store", "fail", unreachable(url, exc))]
    offset = db_now.timestamp() - (before + after) / 2.0
    return [
        Check("store", "ok", f"{url} reachable", value=url),
        clock_skew("clock_skew_store", "store now()", offset, (after - before) / 2, config.max_clock_skew),
    ]


def check_lock_backend(app: Celery, config: SafeTimeConfig) -> list[Check]:
    """The PostgreSQL lock backend (``safe_time_coordination_url``): reachable, its tables, the mode.
    Nothing on Redis: :func:`check_redis` covers the locks there."""
    from .coordination import uses_postgres

    if not uses_postgres(config):
        return []
    from .locks.backends import get_lock_backend

    try:
        store = get_lock_backend(app)
        health = store.health()
        if health is None:
            return []
        rtt, present, held = health
    except Exception as exc:  # driver errors must not crash the probe
        return [Check("locks_postgres", "fail", f"safe_time_coordination_url: {error_text(exc)}")]
    tables = f"{held} locks held" if present else "lock tables not created yet (made at the first lock)"
    detail = f"{store.describe()} reachable (rtt {rtt * 1000:.1f} ms), {config.coordination_locks} locks, {tables}"
    return [Check("locks_postgres", "ok", detail, value=rtt)]


def check_sweep(app: Celery) -> Check:
    """``install(app)`` registered the sweep: without it stored delays are never sent. A warning, not
    a failure: ``check`` is also a probe, and a process may rightly leave the sweep to others; the
    detail says how many rows wait meanwhile."""
    from .delays.backends import get_store
    from .install_check import not_installed_message, sweep_installed

    if sweep_installed(app):
        return Check("sweep", "ok", f"{C.SWEEP_TASK_NAME} task and beat entry installed")
    try:
        waiting: int | None = get_store(app).counts()[C.STATUS_PENDING]
    except Exception:  # the store check says why; this one still names the missing install
        waiting = None
    detail = not_installed_message(app) + ("" if waiting is None else f" ({waiting} stored delays pending)")
    return Check("sweep", "warn", detail, value=waiting)


def version_pairing(celery_version: str, kombu_version: str) -> Check:
    """Celery and kombu of the same minor series (5.4 with 5.4, ..., 5.7 with 5.7) are the tested pairs;
    pip may install a newer kombu beside an older Celery (Celery only asks for kombu below 6)."""
    celery_series = ".".join(celery_version.split(".")[:2])
    kombu_series = ".".join(kombu_version.split(".")[:2])
    pair = f"celery {celery_version}, kombu {kombu_version}"
    if celery_series == kombu_series:
        return Check("versions", "ok", f"{pair} (a tested pair)")
    return Check(
        "versions",
        "warn",
        f"{pair}: not a tested pair (Celery and kombu of the same series are); "
        f"pip install 'kombu=={celery_series}.*' (or 'celery=={kombu_series}.*')",
    )


@dataclasses.dataclass(frozen=True)
class StartupProblem:
    """One thing a worker found wrong at startup: ``fatal`` when it cannot heal by itself (a setting, a
    missing driver), so the worker stops; else a backend that does not answer now (it may in a moment:
    a database failing over, a worker restarted during an outage)."""

    detail: str
    fatal: bool


def worker_startup_problems(app: Celery) -> list[StartupProblem]:
    """What a worker of ``app`` checks before it says "ready", as beat does: its settings, its
    coordination backend (Redis, or PostgreSQL) and its store answer. One problem per backend, naming
    the setting; empty when all is well. Warnings (persistence, clock skew: the backends' clocks are the
    authority, a host's skew is harmless) are ``check``'s, not here."""
    try:
        config = get_config(app)
    except SafeTimeError as exc:
        return [StartupProblem(str(exc), fatal=True)]
    problems = []
    if config.coordination == C.COORDINATION_POSTGRES:
        failed = [c for c in check_coordination(config)[:1] if c.status == "fail"]
        problems += [StartupProblem(f"safe_time_coordination_url: {c.detail}", fatal=False) for c in failed]
    elif config.redis_url:
        failed = [c for c in check_redis(config)[:1] if c.status == "fail"]
        problems += [
            StartupProblem(
                c.detail if c.detail.startswith("safe_time_") else f"safe_time_redis_url: {c.detail}", fatal=False
            )
            for c in failed
        ]
    from .delays.backends import get_store

    try:
        get_store(app).now()
    except Exception as exc:  # a driver's own error class: reported, never raised
        problems.append(
            StartupProblem(f"safe_time_store_url: {unreachable(mask_url(config.store_url), exc)}", _missing_driver(exc))
        )
    return problems


def _missing_driver(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a database driver that is not installed."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ImportError):
            return True
        seen = seen.__cause__
    return False


def run_checks(app: Celery) -> list[Check]:
    """All checks for ``app``; settings errors surface as one failed check."""
    try:
        config = get_config(app)
    except SafeTimeError as exc:
        return [Check("settings", "fail", str(exc))]
    # A misspelt key, or one outside the app's namespace, is ignored (its default is used): valid
    # settings, but not the ones meant.
    unknown = [Check("settings", "warn", message) for message in setting_warnings(app)]
    checks = unknown or [Check("settings", "ok", "all safe_time_* settings valid")]
    checks.append(version_pairing(version("celery"), version("kombu")))
    checks.append(check_broker(config, app))
    if config.redis_url:  # unset only under PostgreSQL coordination, where nothing uses Redis
        checks.extend(check_redis(config))
    if config.coordination == C.COORDINATION_POSTGRES:
        checks.extend(check_coordination(config))
    checks.extend(check_lock_backend(app, config))
    checks.extend(check_store(app, config))
    checks.append(check_sweep(app))
    return checks


def worst(checks: list[Check]) -> Status:
    return max((c.status for c in checks), key=STATUS_ORDER.__getitem__, default="ok")


# The verdicts of ``celery safe-time status --probe beat|sweep|store`` (one each, for Kubernetes) are
# pure functions of what was read, tested without services; the readers (:func:`celery_safe_time.cli.run_probes`)
# reach into beat's backends, which import this module: kept in the command, they tie no import cycle.

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


def shards_verdict(rows: list[dict[str, Any]]) -> Check:
    """``beat`` with ``safe_time_beat_shards`` above 1, from each shard's row (``beat.admin.shard_rows``):
    fails while a shard has no holder (its entries do not fire)."""
    free = [row["shard"] for row in rows if row.get("lease_left_s") is None]
    holders = {(row.get("host"), row.get("pid")) for row in rows if row.get("lease_left_s") is not None}
    lag = max((float(row.get("lag_s") or 0.0) for row in rows), default=0.0)
    value = {"shards": rows, "free": free, "max_lag_s": lag}
    if free:
        return Check(
            "beat",
            "fail",
            f"no beat holds shard(s) {', '.join(map(str, free))} of {len(rows)} (their entries do not fire)",
            value=value,
        )
    return Check("beat", "ok", f"{len(rows)} shards held by {len(holders)} beat(s), max lag {lag:.1f}s", value=value)


def beats_verdict(shards: int, beats: list[dict[str, Any]]) -> Check:
    """``beat shards``: the live beats' ``safe_time_beat_shards`` (``beat.admin.beat_rows``) agree with
    each other and with this app's ``shards`` (fail: a beat with another K takes no shard, or this app's
    setting is not the beats'); their planning fingerprints agree (warn: a moved shard re-plans)."""
    settings = sorted({int(beat["shards_setting"]) for beat in beats})
    fingerprints = sorted({str(beat["fingerprint"]) for beat in beats})
    value = {"shards": shards, "beats": beats}
    if not beats:
        return Check("beat shards", "warn", f"safe_time_beat_shards = {shards}: no live beat heartbeat", value=value)
    if settings != [shards]:
        waiting = [b["beat"] for b in beats if not b["fires"]]
        return Check(
            "beat shards",
            "fail",
            f"safe_time_beat_shards differs: {shards} here, {', '.join(map(str, settings))} on the live beats"
            + (f"; beat(s) {', '.join(waiting)} take no shard until the others are gone" if waiting else ""),
            value=value,
        )
    if len(fingerprints) > 1:
        return Check(
            "beat shards",
            "warn",
            f"{len(beats)} beat(s) with safe_time_beat_shards = {shards} but planning fingerprints differ "
            f"({'; '.join(fingerprints)}): a shard moving between them re-plans its entries",
            value=value,
        )
    return Check(
        "beat shards", "ok", f"{len(beats)} live beat(s), each with safe_time_beat_shards = {shards}", value=value
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
