"""The lean way to run a Lua script: one ``EVALSHA`` written to, and its reply read from, the socket
of a connection the calling thread keeps.

A locked task makes two script calls, and the goal is a lock within 1.1x of two plain Redis round
trips: in a cold prefork child, redis-py's command path around each call (pool checkout, retry
wrapper, encoder, parser, callbacks) cost about a third of the lock's overhead. Here a call is one
``sendall`` and one ``recv``, parsed in one function. The connection comes from the client's pool
(so it has the client's TLS, Sentinel and timeouts), once per thread and process, and is not
health-checked: a call that gets no reply runs again on redis-py's path.

Everything unusual goes through redis-py's ``Script`` instead: an error reply (``NOSCRIPT``,
``READONLY``, a Lua error), a lost or timed-out connection, an unexpected reply type, Redis Cluster,
client-side caching, green threads and instrumented clients. The lock scripts compare tokens, so a
call repeated after one that ran is harmless.

:meth:`LeanScript.post` writes a call without waiting (a task's release or commit as its body
returns); :func:`settle_posted` reads the reply after the task (``task_postrun``) or before the next
call on that connection, and hands it to the caller's ``settle``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis

from .concurrency import green_threads

__all__ = ["LeanLink", "LeanScript", "Settle", "pack_evalsha", "parse_reply", "settle_posted", "settle_with"]

logger = logging.getLogger(__name__)

#: Told a posted call's outcome: (reply, None), or (None, the exception redis-py's path raised).
Settle = Callable[[Any, BaseException | None], None]


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


def _read_reply(sock: Any) -> Any:
    """The next whole reply on ``sock``; :class:`Unexpected` when more than one reply came."""
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


def _open_socket(conn: Any) -> Any:
    sock = conn._sock
    if sock is None:
        conn.connect()
        sock = conn._sock
    return sock


def settle_with(settle: Settle, answer: Callable[[], Any]) -> None:
    """Tell ``settle`` what ``answer()`` returns, or the exception it raises."""
    try:
        value = answer()
    except Exception as exc:
        settle(None, exc)
        return
    settle(value, None)


def _run_now(script: LeanScript, keys: Sequence[str], args: Sequence[str | int | bytes], settle: Settle) -> None:
    """Run a posted call on redis-py's path at once and tell ``settle`` how it went."""
    settle_with(settle, lambda: script.script(keys=keys, args=args))


#: What ends a lean call on the kept connection (closed first) and hands it to redis-py's path: an
#: error or unexpected reply, a dropped or timed-out connection, a reply that does not parse.
_LEFT_TO_REDIS_PY = (Unexpected, redis.RedisError, OSError, ValueError, IndexError)

#: No reply read: the posted call is run again on redis-py's path.
_AGAIN = object()


class _Posted:
    """A call written to the kept connection whose reply has not been read yet."""

    __slots__ = ("args", "keys", "script", "settle")

    def __init__(self, script: LeanScript, keys: Sequence[str], args: Sequence[str | int | bytes], settle: Settle):
        self.script = script
        self.keys = keys
        self.args = args
        self.settle = settle


class _Unsettled(threading.local):
    """The links this thread posted a call on whose reply is still unread (at most a few)."""

    links: list[LeanLink] | None = None


_unsettled = _Unsettled()


def settle_posted() -> None:
    """Read the reply of every call this thread posted and hand each to its ``settle``.

    The worker calls it after every task (see the module doc): a release or commit that Redis did
    not run (``NOSCRIPT``, a closed connection) is run again now, while the delivery is still
    unacknowledged, and not at some later task's lock call that may never come.
    """
    links = _unsettled.links
    if not links:
        return
    _unsettled.links = None
    for link in links:
        link.settle()


class _Kept(threading.local):
    """What one thread keeps for one client: the connection (for the process that took it) and the
    call posted on it whose reply is still unread."""

    pid: int | None = None
    conn: Any = None
    posted: _Posted | None = None


class LeanLink:
    """The lean path of one client: one kept connection per thread and process for all its scripts."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._kept = _Kept()
        pool = getattr(client, "connection_pool", None)
        #: False: every call goes through redis-py's ``Script`` (module doc says when).
        self.lean = bool(
            type(client) is redis.Redis
            and getattr(client, "connection", None) is None
            and pool is not None
            and getattr(pool, "cache", None) is None
            and not hasattr(type(client).execute_command, "__wrapped__")
            and not green_threads()
        )

    def _connection(self) -> Any:
        kept = self._kept
        if kept.pid != os.getpid():
            # A forked child inherits the parent's thread-local: it takes a connection of its own,
            # and a reply the parent was owed is not its to read.
            kept.conn = self.client.connection_pool.get_connection()
            kept.pid = os.getpid()
            kept.posted = None
        return kept.conn

    @property
    def connection(self) -> Any:
        """This thread's kept connection (made on first use)."""
        return self._connection()

    def settle(self) -> None:
        """Read the reply of the call this thread posted, if any, and hand it to its ``settle``."""
        kept = self._kept
        posted = kept.posted
        if posted is None or kept.pid != os.getpid():
            return
        kept.posted = None  # first: the settle callback may make calls of its own
        conn = kept.conn
        reply: Any = _AGAIN
        try:
            sock = conn._sock
            if sock is None:
                raise redis.ConnectionError("the connection closed before the reply was read")
            reply = _read_reply(sock)
        except _LEFT_TO_REDIS_PY:
            # An error reply (NOSCRIPT after a restart, READONLY after a failover) or a connection
            # lost before the reply: run it again on redis-py's path (the scripts posted are safe to
            # repeat).
            conn.disconnect()
        except BaseException:
            conn.disconnect()
            raise
        try:
            if reply is _AGAIN:
                _run_now(posted.script, posted.keys, posted.args, posted.settle)
            else:
                posted.settle(reply, None)
        except Exception:
            # It is called on the next call's way in: that call must not fail for it.
            logger.exception("handling the reply of a lock script sent earlier failed")

    def call(self, script: LeanScript, keys: Sequence[str], args: Sequence[str | int | bytes]) -> Any:
        self.settle()
        conn = self._connection()
        try:
            sock = _open_socket(conn)
            # Not send_packed_command: its health check PINGs a connection idle for a while, but a
            # connection Redis closed is found here anyway (no reply: redis-py's path runs the call).
            sock.sendall(pack_evalsha(script.sha, keys, args))
            return _read_reply(sock)
        except _LEFT_TO_REDIS_PY:
            # An error reply, a dropped connection, a timeout: the connection may hold half a
            # reply, so it is closed; redis-py's path reports, retries or loads the script.
            conn.disconnect()
        except BaseException:
            # Interrupted mid-reply (LockLost raised into this thread, KeyboardInterrupt): the
            # reply may still arrive, so the connection cannot be trusted with the next command.
            conn.disconnect()
            raise
        return script.script(keys=keys, args=args)

    def post(self, script: LeanScript, keys: Sequence[str], args: Sequence[str | int | bytes], settle: Settle) -> None:
        self.settle()
        conn = self._connection()
        try:
            _open_socket(conn).sendall(pack_evalsha(script.sha, keys, args))
        except (redis.RedisError, OSError, ValueError):
            conn.disconnect()  # not written (or only part of it): run it now on redis-py's path
            _run_now(script, keys, args, settle)
        except BaseException:
            conn.disconnect()
            raise
        else:
            self._kept.posted = _Posted(script, keys, args, settle)
            links = _unsettled.links
            if links is None:
                _unsettled.links = [self]
            elif self not in links:
                links.append(self)


class LeanScript:
    """A Lua script called as ``script(keys, args)`` on the lean path where it applies (module doc)."""

    def __init__(self, client: redis.Redis, source: str, link: LeanLink | None = None) -> None:
        self.script = client.register_script(source)
        sha = self.script.sha
        self.sha = sha.encode() if isinstance(sha, str) else bytes(sha)
        #: Shared by the scripts of one client (one kept connection per thread), or this script's own.
        self.link = link if link is not None else LeanLink(client)
        self.lean = self.link.lean

    def __call__(self, keys: Sequence[str], args: Sequence[str | int | bytes]) -> Any:
        if not self.lean:
            return self.script(keys=keys, args=args)
        return self.link.call(self, keys, args)

    def post(self, keys: Sequence[str], args: Sequence[str | int | bytes], settle: Settle) -> None:
        """Run the script without waiting for its reply, which ``settle`` gets later (module doc).

        Off the lean path the call runs now and ``settle`` is told before this returns; so is it when
        the command cannot be written (the call then runs on redis-py's path).
        """
        if self.lean:
            self.link.post(self, keys, args, settle)
        else:
            _run_now(self, keys, args, settle)
