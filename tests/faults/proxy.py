"""A TCP proxy the fault tests can cut and restore: "the database is unreachable" without
touching the machine's PostgreSQL (other sessions share it)."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit, urlunsplit

from tests.helpers.services import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``. ``cut()`` drops every connection and refuses
    new ones (connection refused, as if the server were gone); ``restore()`` listens again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.cuts = 0
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
        if listener is not None:
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.cut()

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
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), name="proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._conns -= {src, dst}


def proxy_for(url: str) -> tuple[TcpProxy, str]:
    """A proxy in front of the database server of ``url`` (port 5432 if none), and ``url`` through it."""
    parts = urlsplit(url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    if parts.port is None:
        netloc = f"{parts.netloc}:{proxy.port}"
    else:
        netloc = parts.netloc.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
    return proxy, urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
