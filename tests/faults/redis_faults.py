"""Redis faults production brings every week, made on a redis-server the test owns
(:class:`~tests.helpers.services.RedisServer`, never the machine's shared one)."""

from __future__ import annotations

import redis

from tests.helpers.services import RedisServer


def empty_script_cache(server: RedisServer) -> None:
    """``SCRIPT FLUSH``: the script cache a restart or a failover to a fresh replica leaves (empty),
    without closing anybody's connection."""
    client = redis.Redis.from_url(server.url)
    try:
        client.script_flush()
    finally:
        client.close()


def restart_cold(server: RedisServer) -> None:
    """Restart ``server``: every connection closed, the script cache and the data gone (no persistence)."""
    server.restart()


def close_idle_connections(server: RedisServer, seconds: int) -> None:
    """``CONFIG SET timeout``: the server closes a connection idle for ``seconds`` (0: never), as a
    Redis with ``timeout`` set or a proxy with an idle cut does; the client learns it only at its
    next read."""
    client = redis.Redis.from_url(server.url)
    try:
        client.config_set("timeout", seconds)
    finally:
        client.close()
