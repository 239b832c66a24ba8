"""Redis client factory: one pooled client per URL and process, with timeouts always set.

``redis://``, ``rediss://`` (TLS), ``unix://``, ``sentinel://`` (the master looked up on every new
connection) and ``redis+cluster://`` / ``rediss+cluster://``; TLS options ride in the URL query, as
redis-py reads them. docs/redis.md lists the forms.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from importlib import resources
from typing import Any, cast, overload
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import redis
from redis.connection import parse_url

from . import constants as C
from .config import mask_url
from .exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT = 5.0
REDIS_CONNECT_TIMEOUT = 5.0
REDIS_HEALTH_CHECK_INTERVAL = 30

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
        "socket_timeout": REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT,
        "health_check_interval": REDIS_HEALTH_CHECK_INTERVAL,
        "retry_on_timeout": False,
        "decode_responses": False,
    }
    options.update(overrides)
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sentinel":
        return _sentinel_master(url, options)
    if scheme in C.REDIS_CLUSTER_SCHEMES:
        return _cluster(url, options)
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
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8
        hosts, sentinel_kwargs={"password": password} if password else None, **options
    )
    client: redis.Redis = sentinel.master_for(master, db=db, password=password)  # type: ignore[no-untyped-call,unused-ignore]
    return client


def _cluster(url: str, options: dict[str, Any]) -> redis.Redis:
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException

    parts = urlsplit(url)
    hostinfo = parts.netloc.rpartition("@")[2]
    nodes: list[ClusterNode] = []
    for hostport in hostinfo.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or "]" in port:
            host, port = hostport, ""
        nodes.append(ClusterNode(host.strip("[]") or "127.0.0.1", int(port or 6379)))  # type: ignore[no-untyped-call]
    db = parts.path.strip("/")
    if db not in ("", "0"):
        raise ImproperlyConfigured(
            "safe_time_redis_url", f"a Redis Cluster has only db 0, the URL names db {db!r} ({mask_url(url)})"
        )
    # The query options (TLS files, timeouts) are parsed the way redis-py parses a single-node URL.
    single = urlunsplit((parts.scheme.split("+")[0], nodes[0].host + ":" + str(nodes[0].port), "", parts.query, ""))
    query_options = {k: v for k, v in parse_url(single).items() if k not in ("host", "port", "connection_class")}  # type: ignore[no-untyped-call]
    if parts.scheme.lower().startswith("rediss"):
        query_options["ssl"] = True
    if parts.username:
        query_options["username"] = unquote(parts.username)
    if parts.password:
        query_options["password"] = unquote(parts.password)
    # retry_on_timeout is deprecated (RedisCluster warns): its default retry covers timeouts, as
    # redis.Redis's own default does since redis-py 6, so a timed-out script may run twice on either.
    # The lock scripts recognise their own token; a dispatch run twice answers "already fired" and
    # that slot is not published (a miss, never a duplicate).
    options = {k: v for k, v in options.items() if k != "retry_on_timeout"}
    # RedisCluster retries on MOVED/ASK and re-reads the slot map after a lost node by itself. It
    # reads that map in its constructor: a failure there is reported as the Redis error it is.
    try:
        client = RedisCluster(startup_nodes=nodes, **{**options, **query_options})
    except (RedisClusterException, redis.RedisError) as exc:
        hint = tls_hint(url, exc)
        if hint is not None:
            raise ImproperlyConfigured("safe_time_redis_url", hint) from exc
        raise redis.ConnectionError(f"Redis Cluster {mask_url(url)}: {exc}") from exc
    # RedisCluster answers every command this package sends (scripts, pipelines without
    # transactions, SCAN over all masters), but shares no base class with redis.Redis.
    return cast(redis.Redis, client)


def is_cluster(client: Any) -> bool:
    """True when ``client`` is a Redis Cluster client."""
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS failure (bad CA, hostname mismatch, plain server) behind a Redis error, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def tls_hint(url: str, exc: BaseException) -> str | None:
    """What to change in ``safe_time_redis_url`` when ``exc`` is a TLS failure, else None."""
    error = tls_error(exc)
    text = str(error if error is not None else exc)
    if error is None and "SSL" not in text and "certificate" not in text:
        return None
    if "hostname" in text or "IP address mismatch" in text:
        fix = (
            "the server certificate does not name this host: connect to a name it lists, or add "
            "ssl_check_hostname=false to the URL query"
        )
    elif "certificate verify failed" in text or "CERTIFICATE_VERIFY_FAILED" in text:
        fix = (
            "the server certificate is not signed by a trusted CA: add ssl_ca_certs=/path/to/ca.pem to the "
            "URL query (ssl_cert_reqs=none turns the check off)"
        )
    else:
        fix = "check the rediss:// URL's ssl_* query options (ssl_ca_certs, ssl_certfile, ssl_keyfile)"
    return f"TLS handshake with {mask_url(url)} failed ({text}): {fix}"


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


def glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis ``MATCH`` glob: ``*``, ``?``, ``[``, ``]`` and ``\\`` escaped.

    A key prefix (``safe_time_key_prefix``) or an entry name holding one of them would otherwise
    match other apps' keys in a SCAN."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
