"""One health verdict (:class:`Check`) and the checks of the service every part shares: Redis (reachable,
its clock against this host, persistence, eviction, replication).

The Redis beat backend's startup checks and ``celery safe-time check``
(:func:`celery_safe_time.checks.run_checks`) read the same rows; nothing here prints.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import redis

from .clock import measure_redis_offset
from .config import SafeTimeConfig, mask_url
from .exceptions import ImproperlyConfigured, RedisUnavailable
from .redis_client import as_text, get_redis, is_cluster, tls_hint

Status = Literal["ok", "warn", "fail"]
STATUS_ORDER: dict[Status, int] = {"ok": 0, "warn": 1, "fail": 2}


#: Policies under which Redis may delete keys that still have a TTL: our leases and locks.
EVICTING_POLICIES_SAFE = frozenset({"noeviction"})


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    value: Any = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def clock_skew(name: str, against: str, offset: float, uncertainty: float, limit: float) -> Check:
    """``name``: this host's clock ``offset`` seconds off ``against``'s, failing beyond ``limit``."""
    return Check(
        name,
        "ok" if abs(offset) <= limit else "fail",
        f"this host vs {against}: {offset:+.4f} s (±{uncertainty:.4f}), limit {limit:g} s",
        value=offset,
    )


def check_redis(config: SafeTimeConfig, client: redis.Redis | None = None) -> list[Check]:
    """Reachability, clock offset against this host, persistence and eviction policy."""
    url = mask_url(config.redis_url)
    try:
        client = client if client is not None else get_redis(config.redis_url)
        offset = measure_redis_offset(client, samples=5)
    except (RedisUnavailable, ImproperlyConfigured, redis.RedisError) as exc:
        hint = tls_hint(config.redis_url, exc)
        if hint is not None:
            return [Check("redis", "fail", f"safe_time_redis_url: {hint}")]
        return [Check("redis", "fail", f"{url} unreachable: {error_text(exc)}")]
    checks = [Check("redis", "ok", f"{url} reachable (rtt {offset.rtt * 1000:.1f} ms)", value=offset.rtt)]
    checks.append(
        clock_skew("clock_skew_redis", "Redis TIME", offset.offset, offset.uncertainty, config.max_clock_skew)
    )
    checks.extend(_redis_config_checks(client))
    return checks


def _redis_config_checks(client: redis.Redis) -> list[Check]:
    """Persistence, eviction and replication of the Redis (of every master, on a cluster)."""
    nodes: list[tuple[str, redis.Redis]] = [("", client)]
    if is_cluster(client):
        nodes = [(n.name, n.redis_connection) for n in client.get_primaries()]  # type: ignore[attr-defined]
    per_node: list[list[Check]] = []
    for name, node in nodes:
        try:
            per_node.append(_node_config_checks(node, name))
        except redis.RedisError as exc:
            # Managed Redis often disables CONFIG: say we could not tell, do not fail the probe.
            where = f" on {name}" if name else ""
            return [
                Check(
                    "redis_config", "warn", f"cannot read CONFIG{where} ({error_text(exc)}); check persistence by hand"
                )
            ]
    # One row per check: the worst node's (all masters of a cluster should be set alike).
    return [max(column, key=lambda c: STATUS_ORDER[c.status]) for column in zip(*per_node, strict=True)]


def _node_config_checks(client: redis.Redis, name: str) -> list[Check]:
    raw: dict[Any, Any] = {}
    for setting in ("appendonly", "appendfsync", "save", "maxmemory-policy", "min-replicas-to-write"):
        raw.update(client.config_get(setting))
    cfg = {as_text(k): as_text(v) for k, v in raw.items()}
    replication = {as_text(k): v for k, v in client.info("replication").items()}
    where = f"{name}: " if name else ""
    appendonly = cfg.get("appendonly", "no")
    save = cfg.get("save", "") or ""
    policy = cfg.get("maxmemory-policy", "noeviction")
    if appendonly == "yes":
        persistence: Status = "ok"
        note = f" (appendfsync={cfg.get('appendfsync', 'everysec')}: a crash loses at most that window)"
    elif save.strip():
        persistence = "warn"
        note = (
            ": RDB snapshots only, a restart rolls back to the last snapshot: fired markers written since are "
            "lost and those slots fire again, locks taken since are forgotten (use appendonly yes)"
        )
    else:
        persistence = "warn"
        note = ": nothing persists, a Redis restart forgets fired slots and locks"
    replicas = int(replication.get("connected_slaves", 0) or 0)
    role = as_text(replication.get("role")) or "master"
    min_replicas = int(cfg.get("min-replicas-to-write", "0") or 0)
    if replicas or role != "master":
        replication_status: Status = "ok" if min_replicas > 0 else "warn"
        replication_detail = f"role={role} connected_slaves={replicas} min-replicas-to-write={min_replicas}" + (
            ""
            if min_replicas > 0
            else ": replication is asynchronous and nothing WAITs for it; a failover can lose the last "
            "writes (a fired marker: that slot fires again; a lock: two holders for up to a lock TTL)"
        )
    else:
        replication_status = "ok"
        replication_detail = f"role={role}, no replicas"
    return [
        Check(
            "redis_persistence",
            persistence,
            f"{where}appendonly={appendonly} save={save!r}" + note,
            value={"appendonly": appendonly, "save": save},
        ),
        Check(
            "redis_eviction",
            "ok" if policy in EVICTING_POLICIES_SAFE else "warn",
            f"{where}maxmemory-policy={policy}"
            + ("" if policy in EVICTING_POLICIES_SAFE else ": leases and locks can be evicted under memory pressure"),
            value=policy,
        ),
        Check(
            "redis_replication",
            replication_status,
            where + replication_detail,
            value={"role": role, "replicas": replicas, "min_replicas_to_write": min_replicas},
        ),
    ]


#: Lines SQLAlchemy adds to a driver's message: the statement, its parameters and a link to its docs.
_SQLALCHEMY_NOTES = ("(Background on this error at:", "[SQL:", "[parameters:")


def error_text(exc: BaseException) -> str:
    """``exc``'s message on one line, without what SQLAlchemy adds to the driver's message (the SQL,
    its parameters, "Background on this error at: <link>"): a check row is one line."""
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.startswith(_SQLALCHEMY_NOTES)]
    return " ".join(kept) or exc.__class__.__name__
