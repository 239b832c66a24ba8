"""A TCP proxy the fault tests can cut, stall and restore: "the database is unreachable" or "this
process's connections hang" without touching the machine's PostgreSQL (other sessions share it)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit

from tests.helpers.services import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``, per connection: pass, stall or cut.

    ``cut()`` drops every connection and refuses new ones (connection refused, as if the server were
    gone); ``restore()`` listens again. ``stall()`` stops forwarding on every connection open now,
    both ways, with the sockets kept open (a hung network path: the client's writes succeed, no reply
    comes, nothing times out on its own); connections made later pass, or with ``new=True`` stall as
    well from their first byte. ``resume()`` lets the stalled ones flow again, with what they held.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._links: set[_Link] = set()
        #: how many connections :meth:`stall` stopped
        self.stalled = 0
        self._stall_new = False
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.cuts = 0
        #: armed by :meth:`lose_reply`: (the bytes to wait for, whether the server gets them)
        self._lose: tuple[bytes, bool] | None = None
        #: how many statements :meth:`lose_reply` caught
        self.replies_lost = 0
        #: armed by :meth:`delay_reply`: (the bytes to wait for, how long to hold the reply, the start
        #: of a reply that is passed at once and leaves the trigger armed)
        self._delay: tuple[bytes, float, bytes | None] | None = None
        #: how many replies :meth:`delay_reply` held
        self.replies_delayed = 0
        self.restore()

    # --- control ------------------------------------------------------------------------
    def restore(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", self.port))
            except OSError:
                sock.close()  # the port is still held (a caller retries): no socket left to the collector
                raise
            sock.listen(256)
            sock.settimeout(0.2)
            self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), name="proxy-accept", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.cuts += 1
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
            links, self._links = self._links, set()
        if listener is not None:
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for link in links:
            link.flowing.set()  # stalled pumps wake up to closed sockets and end

    def stall(self, *, new: bool = False) -> int:
        """Stop forwarding on every connection open now, and with ``new`` on those made later too;
        returns how many were open."""
        with self._lock:
            self._stall_new = new
            links = [link for link in self._links if link.flowing.is_set()]
            for link in links:
                link.flowing.clear()
            self.stalled += len(links)
        return len(links)

    def resume(self) -> None:
        """Let every stalled connection flow again."""
        with self._lock:
            self._stall_new = False
            links = list(self._links)
        for link in links:
            link.flowing.set()

    def close(self) -> None:
        self._stop.set()
        self.cut()

    def lose_reply(self, needle: bytes, *, server_gets_it: bool = True) -> None:
        """Break the connection of the next client message containing ``needle`` (once).

        ``server_gets_it``: the message is forwarded and the connection dropped when the server's
        whole reply is in (its ReadyForQuery: the statement ran and, outside a transaction,
        committed), the reply never reaching the client; otherwise the connection is dropped
        before the server sees the message. Either way the client sees the same broken connection.
        """
        with self._lock:
            self._lose = (needle, server_gets_it)

    def delay_reply(self, needle: bytes, seconds: float, *, unless_reply: bytes | None = None) -> None:
        """Hold the reply to the next client message containing ``needle`` (once) for ``seconds``:
        the server gets the message at once and answers; the answer reaches the client late.

        ``unless_reply``: a reply starting with these bytes is passed at once and the trigger stays
        armed for the next such message (Redis: ``b"-NOSCRIPT"``, the answer to a script call on a
        server whose script cache another client flushed; the client loads the script and sends the
        call again, and that call's reply is the one held).
        """
        with self._lock:
            self._delay = (needle, seconds, unless_reply)

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    # --- plumbing -----------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                if self._listener is not listener:
                    return
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    continue
                self._conns |= {client, upstream}
                link = _Link(client, upstream)
                self._links.add(link)
                if self._stall_new:
                    link.flowing.clear()
                    self.stalled += 1
            threading.Thread(target=self._requests, args=(link,), name="proxy-pump", daemon=True).start()
            threading.Thread(target=self._replies, args=(link,), name="proxy-pump", daemon=True).start()

    def _requests(self, link: _Link) -> None:
        try:
            while True:
                data = link.client.recv(65536)
                if not data:
                    break
                with self._lock:
                    lose = self._lose
                    caught = lose is not None and lose[0] in data
                    if caught:
                        self._lose = None
                        self.replies_lost += 1
                    delay = self._delay
                    if delay is not None and delay[0] in data:
                        self._delay = None
                        self.replies_delayed += 1
                        link.hold_until = time.monotonic() + delay[1]
                        link.held = delay
                if caught and lose is not None:
                    if not lose[1]:
                        break  # dropped before the server saw it
                    link.swallow.set()
                link.flowing.wait()
                link.upstream.sendall(data)
        except OSError:
            pass
        finally:
            if not link.swallow.is_set():
                self._drop(link)

    def _replies(self, link: _Link) -> None:
        pending = b""
        try:
            while True:
                data = link.upstream.recv(65536)
                if not data:
                    break
                if link.swallow.is_set():
                    pending = (pending + data)[-len(_READY_FOR_QUERY) - 1 :]
                    if pending[:-1].endswith(_READY_FOR_QUERY):
                        break  # the whole reply is in: never deliver it
                    continue
                link.flowing.wait()
                if link.hold_until and link.held is not None and link.held[2] and data.startswith(link.held[2]):
                    with self._lock:  # not the reply to hold: pass it, and wait for the next call
                        if self._delay is None:
                            self._delay = link.held
                            self.replies_delayed -= 1
                    link.hold_until, link.held = 0.0, None
                if link.hold_until:
                    # The held reply and whatever follows it on this connection wait together.
                    time.sleep(max(0.0, link.hold_until - time.monotonic()))
                    link.hold_until, link.held = 0.0, None
                link.client.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        for s in (link.client, link.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        link.flowing.set()  # a stalled pump wakes up to find its sockets closed
        with self._lock:
            self._conns -= {link.client, link.upstream}
            self._links.discard(link)


#: The PostgreSQL protocol's ReadyForQuery message, without its status byte: the end of a reply.
_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"


class _Link:
    """One proxied connection: the client's socket, the server's, whether to swallow the reply, and
    whether it flows."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.swallow = threading.Event()
        #: cleared while the connection is stalled: the pumps hold what they read
        self.flowing = threading.Event()
        self.flowing.set()
        #: when a held reply (:meth:`TcpProxy.delay_reply`) may go on (monotonic), or 0
        self.hold_until = 0.0
        #: the :meth:`TcpProxy.delay_reply` trigger that set ``hold_until``
        self.held: tuple[bytes, float, bytes | None] | None = None


def proxy_for(url: str) -> tuple[TcpProxy, str]:
    """A proxy in front of the database server of ``url`` (port 5432 if none), and ``url`` through it."""
    parts = urlsplit(url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    if parts.port is None:
        netloc = f"{parts.netloc}:{proxy.port}"
    else:
        netloc = parts.netloc.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
    return proxy, urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
