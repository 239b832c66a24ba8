"""Helpers for the overlap-lock tests: start the locks app worker, read what its tasks recorded."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
from typing import Any

import redis
from celery import Celery

from tests.helpers import services
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for
from tests.helpers.services import free_port

APP = "tests.apps.locks_app"
RUNS = "test:locks:runs"
SIGNALS = "test:locks:signals"
STARTS = "test:locks:starts"


def start_worker(
    processes: ProcessManager,
    *,
    name: str = "locks",
    ttl: float = 3.0,
    retry_after: float = 0.5,
    concurrency: int = 8,
    env: dict[str, str] | None = None,
) -> CeleryProcess:
    worker = processes.worker(
        APP,
        name=name,
        concurrency=concurrency,
        env={"SAFE_TIME_TEST_LOCK_TTL": str(ttl), "SAFE_TIME_TEST_RETRY_AFTER": str(retry_after), **(env or {})},
    )
    worker.wait_for_log(r"ready\.", timeout=90)
    return worker


def broker_env(
    broker_url: str,
    redis_url: str,
    visibility_timeout: float | None = None,
    coordination: dict[str, Any] | None = None,
    **conf: Any,
) -> dict[str, str]:
    """Worker env for ``broker_url`` (Redis, RabbitMQ or SQS) with locks, results and records on ``redis_url``.

    ``coordination``: the ``coordination_conf`` fixture's settings; with a PostgreSQL one the locks are
    there and the app has no ``safe_time_redis_url`` (results and the test's records stay on Redis).
    """
    options: dict[str, Any] = {"result_backend": redis_url, "safe_time_redis_url": redis_url, **conf}
    if coordination:
        options.pop("safe_time_redis_url")
        options.update(coordination)
    if broker_url.startswith("redis") and visibility_timeout is not None:
        options["broker_transport_options"] = {"visibility_timeout": visibility_timeout, **services.REDIS_FAST_RESTORE}
    if broker_url.startswith("sqs"):
        extra = {} if visibility_timeout is None else {"visibility_timeout": visibility_timeout}
        options.update(services.broker_conf(broker_url, **extra))
    return {
        "SAFE_TIME_TEST_BROKER_URL": broker_url,
        "SAFE_TIME_TEST_REDIS_URL": redis_url,
        "SAFE_TIME_TEST_APP_CONF": json.dumps(options),
    }


def client_app(redis_url: str, broker_url: str | None = None, **conf: Any) -> Celery:
    broker = broker_url or redis_url
    app = Celery("locks-client", broker=broker, backend=redis_url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, **{**services.broker_conf(broker), **conf})
    return app


def runs(client: redis.Redis, name: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(RUNS, 0, -1)]
    return [r for r in found if name is None or r["name"] == name]


def signals(client: redis.Redis, signal: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(SIGNALS, 0, -1)]
    return [s for s in found if signal is None or s["signal"] == signal]


def wait_runs(client: redis.Redis, name: str, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    wait_for(lambda: len(runs(client, name)) >= count, timeout, message=f"{count} runs of {name}")
    return runs(client, name)


def most_in_any_window(starts: list[float], window: float) -> int:
    """The largest number of ``starts`` (epoch seconds on the backend's clock) inside one window
    ``[s, s + window)``, as the rate rule counts them: a start exactly ``window`` old has aged out
    (the backends drop starts at or before ``now - period``). Counted in whole microseconds, the
    backends' resolution, so float rounding cannot move a start across the window's edge."""
    ticks = sorted(round(s * 1_000_000) for s in starts)
    width = round(window * 1_000_000)
    best, j = 0, 0
    for i, tick in enumerate(ticks):
        while ticks[j] <= tick - width:
            j += 1
        best = max(best, i - j + 1)
    return best


def overlaps(intervals: list[tuple[float, float]]) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Pairs of intervals that overlap (sorted by start)."""
    ordered = sorted(intervals)
    return [(a, b) for a, b in itertools.pairwise(ordered) if b[0] < a[1]]


def lock_fields(client: redis.Redis, key: str, prefix: str = "safe_time:") -> dict[str, str]:
    raw = client.hgetall(f"{prefix}lock:{key}")
    return {k.decode(): v.decode() for k, v in raw.items()}


def starts(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(STARTS, 0, -1)]


class ReplyDropper:
    """A TCP proxy in front of Redis that loses replies: for the next ``drops`` requests containing
    ``marker`` (e.g. a script's SHA1) it forwards the request, so Redis runs it, then throws the
    reply away and closes the connection, as a reset or a timed-out socket would."""

    def __init__(self, target: tuple[str, int], marker: bytes, drops: int) -> None:
        self.target = target
        self.marker = marker
        self.drops = drops
        self.drops_left = drops
        self.dropped = 0
        self.port = free_port()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="reply-dropper", daemon=True).start()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        self._closed.set()
        self._listener.close()

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drops_left <= 0:
                return False
            self.drops_left -= 1
            return True

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            drop_next = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, drop_next), daemon=True).start()
            threading.Thread(target=self._down, args=(client, upstream, drop_next), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, drop_next: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                # Decided before forwarding, so the reply can only arrive after the flag is set.
                if self.marker in data and self._take_drop():
                    drop_next.set()
                upstream.sendall(data)
        self._close(client, upstream)

    def _down(self, client: socket.socket, upstream: socket.socket, drop_next: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if drop_next.is_set():
                    with self._lock:
                        self.dropped += 1
                    break
                client.sendall(data)
        self._close(client, upstream)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def reset_postgres_locks(url: str) -> None:
    """Delete every lock, marker and unique row of the PostgreSQL coordination backend (if its
    tables exist yet) in this test's database."""
    import sqlalchemy as sa

    from celery_safe_time import constants as C

    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for table in (C.PG_LOCK_TABLE, C.PG_LOCK_MARKER_TABLE, C.PG_UNIQUE_TABLE):
                if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": table}).scalar() is not None:
                    conn.execute(sa.text(f"DELETE FROM {table}"))
    finally:
        engine.dispose()


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of ``intervals`` (start, end) open at one instant: how many ran at once at the peak."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = running = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best
