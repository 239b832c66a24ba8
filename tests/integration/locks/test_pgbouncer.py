"""PostgreSQL locks behind PgBouncer in transaction mode (a throwaway ``pgbouncer`` on a random port):
lease rows work, session advisory locks do not (docs/locks.md says so; this shows why)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import Celery

from celery_safe_time.locks.backends import LockBackend, Owner, get_lock_backend
from tests.helpers import services

pytestmark = pytest.mark.integration


def owner(task_id: str) -> Owner:
    return Owner(task_id=task_id, identity=f"{task_id}:0:0", host="test-host", pid=4242)


@pytest.fixture
def pgbouncer_url(postgres_coordination_url: str) -> Iterator[str]:
    """The test's PostgreSQL database through a PgBouncer of its own, ``pool_mode = transaction``, one
    server connection (so every client shares it, as a busy pool eventually makes them)."""
    with _pgbouncer(postgres_coordination_url, pool_size=1) as url:
        yield url


@pytest.fixture
def pgbouncer_pool_url(postgres_coordination_url: str) -> Iterator[str]:
    """The same with three server connections: consecutive statements land on different ones."""
    with _pgbouncer(postgres_coordination_url, pool_size=3) as url:
        yield url


@contextlib.contextmanager
def _pgbouncer(postgres_coordination_url: str, pool_size: int) -> Iterator[str]:
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        services.unavailable("PgBouncer", "pgbouncer", "binary not found")
    # PgBouncer refuses to run as root: run it as nobody, from a directory nobody can read and write.
    tmp_path = Path(tempfile.mkdtemp(prefix="safe-time-pgbouncer-"))
    tmp_path.chmod(0o777)
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    target = urlsplit(postgres_coordination_url)
    port = services.free_port()
    (tmp_path / "users.txt").write_text(f'"{target.username}" ""\n')
    (tmp_path / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={target.hostname} port={target.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {tmp_path / 'users.txt'}\n"
        f"pool_mode = transaction\ndefault_pool_size = {pool_size}\nmax_client_conn = 50\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {tmp_path / 'pgbouncer.log'}\n"
    )
    proc = subprocess.Popen(
        [binary, *as_user, str(tmp_path / "pgbouncer.ini")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("pgbouncer did not start:\n" + (tmp_path / "pgbouncer.log").read_text())
            time.sleep(0.05)
    netloc = f"{target.username}@127.0.0.1:{port}"
    yield urlunsplit((target.scheme, netloc, target.path, target.query, ""))
    from celery_safe_time.coordination import dispose_engines

    dispose_engines()
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(tmp_path, ignore_errors=True)


def _store(make_app: Callable[..., Celery], url: str, mode: str) -> LockBackend:
    return get_lock_backend(make_app(safe_time_coordination_url=url, safe_time_coordination_locks=mode))


def test_lease_locks_work_behind_pgbouncer_transaction_mode(
    make_app: Callable[..., Celery], pgbouncer_pool_url: str
) -> None:
    store = _store(make_app, pgbouncer_pool_url, "lease")
    # Other clients of the same PgBouncer keep its server connections changing hands in between, so
    # consecutive statements of this process land on different server sessions.
    stop = threading.Event()

    def churn() -> None:
        import psycopg

        with psycopg.connect(
            pgbouncer_pool_url.replace("postgresql+psycopg://", "postgresql://"),
            autocommit=True,
            prepare_threshold=None,
        ) as c:
            while not stop.is_set():
                c.execute("SELECT pg_sleep(0.002)")

    churners = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for thread in churners:
        thread.start()
    # more calls of each statement than psycopg's prepare threshold (5): a server-side prepared
    # statement would be missing on the next server connection PgBouncer hands out
    fences = []
    for n in range(20):
        first = store.acquire("pgb", f"tok-{n}", 30, owner(f"a{n}"))
        assert first.status == "acquired"
        fences.append(first.fence)
        assert store.acquire("pgb", f"other-{n}", 30, owner(f"b{n}")).status == "held"
        assert store.renew("pgb", f"tok-{n}", 30)
        assert store.release("pgb", f"tok-{n}", (f"a{n}:0:0", 60, f"a{n}"))
        assert store.acquire("pgb", f"late-{n}", 30, owner(f"a{n}")).status == "finished"
        assert store.acquire(f"idem:i{n}", f"t{n}", 30, owner(f"c{n}"), marker=f"i{n}").status == "acquired"
        assert store.commit(f"idem:i{n}", f"i{n}", f"t{n}", 60, f"c{n}") == (True, True)
        assert store.unique_acquire(f"u{n}", f"u{n}", 60, "queued", stored=False, host="h").status == "acquired"
        assert store.unique_release(f"u{n}", f"u{n}")
    stop.set()
    for thread in churners:
        thread.join(5)
    assert fences == sorted(set(fences))
    assert [i.key for i in store.scan()] == []


def test_session_advisory_locks_do_not_exclude_behind_pgbouncer_transaction_mode(
    make_app: Callable[..., Celery], pgbouncer_url: str, postgres_coordination_url: str
) -> None:
    """Why docs/locks.md says so: the advisory lock belongs to the server connection, which PgBouncer
    hands to the next client after each transaction; that client's try succeeds on the same session."""
    store = _store(make_app, pgbouncer_url, "session")
    assert store.acquire("adv", "tok-a", 30, owner("a")).status == "acquired"
    # a second holder gets in: both run "under" the lock
    assert store.acquire("adv", "tok-b", 30, owner("b")).status == "acquired"
    # the same two calls on a direct connection exclude as they should
    direct = _store(make_app, postgres_coordination_url, "session")
    assert direct.acquire("adv-direct", "tok-a", 30, owner("a")).status == "acquired"
    assert direct.acquire("adv-direct", "tok-b", 30, owner("b")).status == "held"
    direct.close()
    store.close()
