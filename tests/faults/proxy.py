"""A TCP proxy the fault tests put in front of a server (PostgreSQL, Redis) to pass, stall or cut
its connections: "the database is unreachable", "a proxy stopped forwarding", without touching the
machine's shared servers (other sessions use them)."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit, urlunsplit

from tests.helpers.services import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``. ``cut()`` drops every connection and refuses
    new ones (connection refused, as if the server were gone); ``restore()`` listens again.
    ``stall()`` stops forwarding on the connections open now (or on the ones given) while keeping
    them open: what the client sees of a hung proxy or a network path that stopped delivering (its
    writes are accepted, no answer ever comes, nothing is closed); new connections still pass.
    ``resume()`` delivers what was held back and passes again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        #: the proxied connections open now, oldest first
        self.links: list[_Link] = []
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.cuts = 0
        #: armed by :meth:`lose_reply`: (the bytes to wait for, whether the server gets them)
        self._lose: tuple[bytes, bool] | None = None
        #: how many statements :meth:`lose_reply` caught
        self.replies_lost = 0
        self.restore()

    # --- control ------------------------------------------------------------------------
    def restore(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(256)
            sock.settimeout(0.2)
            self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), name="proxy-accept", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.cuts += 1
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
            links = list(self.links)
        for link in links:
            link.flowing.set()  # a stalled pump then finds its socket closed and ends
        if listener is not None:
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.resume()
        self.cut()

    def stall(self, links: list[_Link] | None = None) -> list[_Link]:
        """Stop forwarding on ``links`` (default: every connection open now); returns them."""
        with self._lock:
            chosen = list(self.links) if links is None else links
        for link in chosen:
            link.flowing.clear()
        return chosen

    def resume(self) -> None:
        """Forward again on every stalled connection."""
        with self._lock:
            links = list(self.links)
        for link in links:
            link.flowing.set()

    def lose_reply(self, needle: bytes, *, server_gets_it: bool = True) -> None:
        """Break the connection of the next client message containing ``needle`` (once).

        ``server_gets_it``: the message is forwarded and the connection dropped when the server's
        whole reply is in (its ReadyForQuery: the statement ran and, outside a transaction,
        committed), the reply never reaching the client; otherwise the connection is dropped
        before the server sees the message. Either way the client sees the same broken connection.
        """
        with self._lock:
            self._lose = (needle, server_gets_it)

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
                self.links.append(link)
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
        with self._lock:
            self._conns -= {link.client, link.upstream}
            if link in self.links:
                self.links.remove(link)


#: The PostgreSQL protocol's ReadyForQuery message, without its status byte: the end of a reply.
_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"


class _Link:
    """One proxied connection: the client's socket, the server's, and whether to swallow the reply."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.swallow = threading.Event()
        #: cleared while the connection is stalled (:meth:`TcpProxy.stall`)
        self.flowing = threading.Event()
        self.flowing.set()


def proxy_for(url: str) -> tuple[TcpProxy, str]:
    """A proxy in front of the database server of ``url`` (port 5432 if none), and ``url`` through it."""
    parts = urlsplit(url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    if parts.port is None:
        netloc = f"{parts.netloc}:{proxy.port}"
    else:
        netloc = parts.netloc.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
    return proxy, urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
