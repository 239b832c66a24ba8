"""The lean way to run a Lua script: one ``EVALSHA`` written to, and its reply read from, the socket
of a connection the calling thread keeps.

Why: a locked task makes two script calls (acquire before the body, release after it), and the goal
is a lock within 1.1x of two plain Redis round trips. In a prefork pool child, whose Python is cold
between tasks, redis-py's command path around each call (a pool checkout that polls the socket for
stray data, the retry wrapper, its metrics hooks, argument packing through the encoder, the RESP
parser's buffer and recursion, the response callback lookup) cost about a third of the lock's
overhead. Here a call is one ``sendall`` of a packed command and one ``recv`` of a reply small
enough to arrive whole (more are read when it does not), parsed in one function.

The connection is checked out of the client's pool once per thread and process, so it has the
client's settings (TLS, Sentinel's master discovery, timeouts), and is never handed to anyone else.
It is not health-checked before a call: one Redis closed (idle timeout, restart) gives no reply, and
the call then runs on redis-py's path, which checks and retries as it always does.

Everything unusual goes through redis-py's :class:`~redis.commands.core.Script` instead, which
loads a script Redis does not know and types and retries errors as redis-py does: an error reply
(``NOSCRIPT``, ``READONLY`` after a failover, a Lua error), a lost or timed-out connection (the
connection is dropped first; the lock scripts recognise their own token, so one that ran before the
connection failed is not taken twice), a reply type the scripts never send (a RESP3 push), a Redis
Cluster or single-connection client, client-side caching, green threads (a kept connection per
greenlet would be a connection per task) and a client an instrumentation wrapped (its spans and
metrics stay complete).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import redis

from .concurrency import green_threads

__all__ = ["LeanScript", "pack_evalsha", "parse_reply"]


class Incomplete(Exception):
    """Raised when the bytes read so far end inside a reply (read more and parse again)."""


class Unexpected(Exception):
    """Raised when a reply is an error or of a type the lean path leaves to redis-py."""


def pack_evalsha(sha: bytes, keys: Sequence[str], args: Sequence[str | int | bytes]) -> bytes:
    """``EVALSHA sha len(keys) *keys *args`` in the Redis protocol, one bytes object.

    Arguments are ``str`` (UTF-8, as redis-py's default encoder), ``int`` or ``bytes``. A loop in
    the function, not comprehensions: each of those is a frame of its own, per call.
    """
    count = b"%d" % len(keys)
    out = [
        b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
        % (len(keys) + len(args) + 3, len(sha), sha, len(count), count)
    ]
    for value in (*keys, *args):
        data: bytes
        if isinstance(value, str):
            data = value.encode()
        elif isinstance(value, bytes):
            data = value
        elif type(value) is int:  # not bool, as redis-py's encoder refuses it
            data = b"%d" % value
        else:
            raise redis.DataError(f"invalid script argument {value!r}: str, bytes or int expected")
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


def parse_reply(data: bytes, pos: int = 0) -> tuple[Any, int]:
    """One RESP2/RESP3 reply from ``data[pos:]`` and where it ends.

    Bulk strings come back as bytes, integers as int, nulls as None, arrays as lists. Raises
    :class:`Incomplete` when ``data`` ends inside the reply, :class:`Unexpected` for an error reply
    and for any type a script's reply never has.
    """
    end = data.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind = data[pos]
    if kind == 36:  # $ bulk string
        size = int(data[pos + 1 : end])
        if size < 0:
            return None, end + 2
        stop = end + 2 + size
        if len(data) < stop + 2:
            raise Incomplete
        return data[end + 2 : stop], stop + 2
    if kind == 58:  # : integer
        return int(data[pos + 1 : end]), end + 2
    if kind == 42:  # * array
        count = int(data[pos + 1 : end])
        if count < 0:
            return None, end + 2
        items = []
        pos = end + 2
        for _ in range(count):
            item, pos = parse_reply(data, pos)
            items.append(item)
        return items, pos
    if kind == 43:  # + simple string
        return data[pos + 1 : end], end + 2
    if kind == 95:  # _ null (RESP3)
        return None, end + 2
    raise Unexpected(data[pos:end][:200])


class LeanScript:
    """A Lua script called as ``script(keys, args)`` on the lean path where it applies (module doc)."""

    def __init__(self, client: redis.Redis, source: str) -> None:
        self.script = client.register_script(source)
        self.client = client
        sha = self.script.sha
        self._sha = sha.encode() if isinstance(sha, str) else bytes(sha)
        self._local = threading.local()
        pool = getattr(client, "connection_pool", None)
        self.lean = bool(
            type(client) is redis.Redis
            and getattr(client, "connection", None) is None
            and pool is not None
            and getattr(pool, "cache", None) is None
            and not hasattr(type(client).execute_command, "__wrapped__")
            and not green_threads()
        )

    def __call__(self, keys: Sequence[str], args: Sequence[str | int | bytes]) -> Any:
        if not self.lean:
            return self.script(keys=keys, args=args)
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            # A forked child inherits the parent's thread-local: it takes a connection of its own.
            local.conn = self.client.connection_pool.get_connection()
            local.pid = os.getpid()
        conn = local.conn
        try:
            sock = conn._sock
            if sock is None:
                conn.connect()
                sock = conn._sock
            # Not send_packed_command: its health check PINGs a connection idle for a while, but a
            # connection Redis closed is found here anyway (no reply: redis-py's path runs the call).
            sock.sendall(pack_evalsha(self._sha, keys, args))
            data = sock.recv(65536)
            while True:
                if not data:
                    raise redis.ConnectionError("Redis closed the connection")
                try:
                    reply, end = parse_reply(data)
                except Incomplete:
                    data += sock.recv(65536)
                    continue
                if end != len(data):
                    raise Unexpected(data[end:][:200])
                return reply
        except (Unexpected, redis.RedisError, OSError, ValueError, IndexError):
            # An error reply, a dropped connection, a timeout: the connection may hold half a
            # reply, so it is closed; redis-py's path reports, retries or loads the script.
            conn.disconnect()
        except BaseException:
            # Interrupted mid-reply (LockLost raised into this thread, KeyboardInterrupt): the
            # reply may still arrive, so the connection cannot be trusted with the next command.
            conn.disconnect()
            raise
        return self.script(keys=keys, args=args)
