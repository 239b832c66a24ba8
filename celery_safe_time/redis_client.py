"""Redis client factory: one pooled client per URL and process, with timeouts always set.

Supports ``redis://``, ``rediss://`` (TLS), ``unix://`` and
``sentinel://[:password@]host:port[,host:port...]/db?master=name`` (the master is
discovered through Sentinel on every new connection, so a Redis failover is followed).
"""

from __future__ import annotations

import logging
import os
import threading
from importlib import resources
from typing import Any, overload
from urllib.parse import parse_qs, unquote, urlsplit

import redis

from . import constants as C
from .config import mask_url
from .exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

_clients: dict[tuple[int, str], redis.Redis] = {}
_clients_lock = threading.Lock()


def get_redis(url: str) -> redis.Redis:
    """Return a shared client for ``url`` in this process (a new pool after ``fork``)."""
    key = (os.getpid(), url)
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = create_redis(url)
                _clients[key] = client
    return client


def create_redis(url: str, **overrides: Any) -> redis.Redis:
    """Build a new client for ``url`` with socket timeouts and health checks set."""
    options: dict[str, Any] = {
        "socket_timeout": C.REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": C.REDIS_CONNECT_TIMEOUT,
        "health_check_interval": C.REDIS_HEALTH_CHECK_INTERVAL,
        "retry_on_timeout": False,
        "decode_responses": False,
    }
    options.update(overrides)
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sentinel":
        return _sentinel_master(url, options)
    if scheme not in ("redis", "rediss", "unix"):
        raise ImproperlyConfigured("safe_time_redis_url", f"unknown scheme {scheme!r} in {mask_url(url)}")
    if scheme == "unix":
        # health checks on unix sockets are fine; socket_connect_timeout is not accepted by every version
        options.pop("socket_connect_timeout", None)
    return redis.Redis.from_url(url, **options)


def _sentinel_master(url: str, options: dict[str, Any]) -> redis.Redis:
    from redis.sentinel import Sentinel

    parts = urlsplit(url)
    hostinfo = parts.netloc.rpartition("@")[2]
    password = unquote(parts.password) if parts.password else None
    hosts: list[tuple[str, int]] = []
    for hostport in hostinfo.split(","):
        host, _, port = hostport.partition(":")
        hosts.append((host or "127.0.0.1", int(port or 26379)))
    query = parse_qs(parts.query)
    names = query.get("master") or query.get("master_name") or query.get("service_name") or []
    master = names[0] if names else None
    if not master:
        raise ImproperlyConfigured("safe_time_redis_url", f"a sentinel:// URL needs ?master=<name> ({mask_url(url)})")
    db = int(parts.path.strip("/") or 0)
    options = {k: v for k, v in options.items() if k != "health_check_interval"}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        hosts, sentinel_kwargs={"password": password} if password else None, **options
    )
    client: redis.Redis = sentinel.master_for(master, db=db, password=password)  # type: ignore[no-untyped-call]
    return client


@overload
def as_text(value: None) -> None: ...
@overload
def as_text(value: Any) -> str: ...
def as_text(value: Any) -> str | None:
    """A Redis reply value as text (replies are bytes: clients are built with ``decode_responses=False``)."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def load_script(package: str, name: str) -> str:
    """The Lua source ``<package>/lua/<name>.lua``, shipped as package data."""
    return resources.files(package).joinpath("lua").joinpath(f"{name}.lua").read_text(encoding="utf-8")
