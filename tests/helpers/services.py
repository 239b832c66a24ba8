"""Find (or start) the real Redis, PostgreSQL and MariaDB the tests use.

Order: the URL from ``SAFE_TIME_TEST_REDIS_URL`` / ``SAFE_TIME_TEST_DATABASE_URL`` /
``SAFE_TIME_TEST_MYSQL_URL`` (defaults: the local services), then a throwaway server if its binary
is installed (Redis, PostgreSQL), else skip locally and fail under ``CI`` naming the Debian package
to install.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
IN_CI = bool(os.environ.get("CI"))
#: Redis's default port: with no Redis in a run, none of its processes may hold a connection to it.
REDIS_DEFAULT_PORT = 6379


def unavailable(what: str, package: str, detail: str) -> None:
    message = f"{what} is not reachable ({detail}); install it with: apt-get install {package}"
    if IN_CI:
        pytest.fail(f"CI requires a real {message}", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_ping(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping())
    except redis.RedisError:
        return False


@dataclass
class RedisServer:
    """A redis-server process owned by the tests (for restart/stop faults)."""

    port: int
    dir: str
    proc: subprocess.Popen[bytes] | None = None
    #: ``--requirepass``; the URL then carries it.
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server", "redis-server", "binary not found")
        assert binary is not None
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if redis_ping(self.url):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_throwaway_redis() -> RedisServer:
    server = RedisServer(port=free_port(), dir=tempfile.mkdtemp(prefix="safe-time-redis-"))
    server.start()
    atexit.register(server.stop)
    return server


def resolve_redis_base() -> str:
    """The Redis URL (without db) for this test session."""
    url = os.environ.get("SAFE_TIME_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    if redis_ping(url):
        return url
    if shutil.which("redis-server"):
        return start_throwaway_redis().url
    unavailable("Redis", "redis-server", f"{url} did not answer PING")
    raise AssertionError("unreachable")


class RedisDbClaim:
    """Claims one Redis db number (1..15) for this test session so concurrent runs never collide.

    The claim is a key with a TTL in db 0, refreshed by :meth:`refresh` from each test.
    """

    TTL_MS = 15 * 60 * 1000

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.token = uuid.uuid4().hex
        self.client = redis.Redis.from_url(with_db(base_url, 0))
        self.db = self._claim()
        atexit.register(self.release)

    def _claim(self) -> int:
        forced = os.environ.get("SAFE_TIME_TEST_REDIS_DB")
        if forced:
            return int(forced)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for db in range(1, 16):
                if self.client.set(f"safe_time_test:db:{db}", self.token, nx=True, px=self.TTL_MS):
                    return db
            time.sleep(1)
        raise RuntimeError("all Redis dbs 1..15 are claimed by other test sessions")

    def refresh(self) -> None:
        self.client.pexpire(f"safe_time_test:db:{self.db}", self.TTL_MS)

    def release(self) -> None:
        try:
            key = f"safe_time_test:db:{self.db}"
            if self.client.get(key) == self.token.encode():
                self.client.delete(key)
        except redis.RedisError:
            pass

    @property
    def url(self) -> str:
        return with_db(self.base_url, self.db)


def with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


# --- PostgreSQL -------------------------------------------------------------


def _pg_connect(url: str):  # type: ignore[no-untyped-def]
    import psycopg

    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True, connect_timeout=3)


def pg_ping(url: str) -> bool:
    try:
        with _pg_connect(url) as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:
        return False


def start_throwaway_postgres() -> str | None:
    """initdb + postgres on a free port in a temp dir, if the server binaries are installed."""
    bindirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    if not bindirs:
        return None
    bindir = bindirs[0]
    datadir = tempfile.mkdtemp(prefix="safe-time-pg-")
    port = free_port()
    if os.geteuid() == 0:
        return None  # postgres refuses to run as root; leave it to the machine's service
    initdb = [str(bindir / "initdb"), "-D", datadir, "-A", "trust", "-U", "postgres"]
    subprocess.run(initdb, check=True, stdout=subprocess.DEVNULL)
    server = [str(bindir / "postgres"), "-D", datadir, "-p", str(port), "-k", datadir, "-h", "127.0.0.1"]
    proc = subprocess.Popen(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(proc.terminate)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if pg_ping(url):
            return url
        time.sleep(0.2)
    return None


def resolve_postgres_admin_url() -> str:
    url = os.environ.get("SAFE_TIME_TEST_DATABASE_URL", DEFAULT_DATABASE_URL)
    if pg_ping(url):
        return url
    started = start_throwaway_postgres()
    if started:
        return started
    unavailable("PostgreSQL", "postgresql", f"{url.split('@')[-1]} did not answer")
    raise AssertionError("unreachable")


def _pg_bindir() -> Path | None:
    bindirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    if bindirs:
        return bindirs[0]
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


class PostgresServer:
    """A PostgreSQL server of the test's own (``initdb`` + ``pg_ctl``, a free loopback port, data in a
    temp dir), for faults that restart it: the machine's server, which other tests share, is never
    touched. Run as the ``postgres`` user when the tests run as root (postgres refuses root).
    ``restart("fast")`` is an orderly restart; ``restart("immediate")`` is a crash (no checkpoint, no
    flush of the WAL buffers, recovery at the next start), as when the server process is killed."""

    USER = "postgres"

    def __init__(self) -> None:
        bindir = _pg_bindir()
        if bindir is None:
            unavailable("PostgreSQL server binaries", "postgresql", "initdb/pg_ctl not found")
        assert bindir is not None
        self.bindir = bindir
        # Not under pytest's tmp_path: its parents are closed to the postgres user.
        self.dir = Path(tempfile.mkdtemp(prefix="safe-time-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.restarts = 0

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        user = self.USER if os.geteuid() == 0 else None
        return subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            user=user,
            cwd=self.dir,
        )

    def _check(self, out: subprocess.CompletedProcess[str], what: str) -> None:
        if out.returncode != 0:
            log = (self.dir / "server.log").read_text()[-2000:] if (self.dir / "server.log").exists() else ""
            raise RuntimeError(f"{what} failed ({out.returncode}): {out.stderr.strip()}\n{log}")

    def start(self) -> PostgresServer:
        if os.geteuid() == 0:
            shutil.chown(self.dir, self.USER, self.USER)
        if not self.data.exists():
            self._check(self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres"), "initdb")
            # In the config file, so every later ``pg_ctl start`` uses them. Default durability otherwise
            # (fsync, synchronous_commit on): the restarts test what a real server keeps.
            with open(self.data / "postgresql.conf", "a") as conf:
                conf.write(
                    f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.dir}'\nmax_connections = 300\n"
                )
        atexit.register(self.stop)  # also when the test is cut short (stop is idempotent)
        out = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60", "start")
        self._check(out, "pg_ctl start")
        return self

    def restart(self, mode: str = "fast", down: float = 0.0) -> subprocess.CompletedProcess[str]:
        """``pg_ctl stop -m <mode>``, ``down`` seconds with no server, ``pg_ctl start``: every
        connection is dropped; ``immediate`` is a crash and the start runs crash recovery."""
        self.restarts += 1
        stop = self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")
        if stop.returncode != 0:
            return stop
        time.sleep(down)
        log = str(self.dir / "server.log")  # without -l the server would keep our stdout pipe open
        return self._run("pg_ctl", "-D", str(self.data), "-l", log, "-w", "-t", "120", "start")

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresDatabase:
    """A fresh database created for this test session and dropped at its end."""

    def __init__(self, admin_url: str, options: str = "") -> None:
        """``options``: the rest of the ``CREATE DATABASE`` statement (its locale, say)."""
        self.admin_url = admin_url
        self.name = f"safe_time_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with _pg_connect(admin_url) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}" {options}')
        parts = urlsplit(admin_url)
        self.url = urlunsplit((parts.scheme, parts.netloc, f"/{self.name}", parts.query, ""))

    def drop(self) -> None:
        try:
            with _pg_connect(self.admin_url) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        except Exception:
            pass


# --- MariaDB / MySQL ----------------------------------------------------------


def _mysql_engine(url: str) -> sa.Engine:
    return sa.create_engine(
        url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )


def mysql_ping(url: str) -> bool:
    engine = _mysql_engine(url)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return True
    except Exception:
        return False
    finally:
        engine.dispose()


def resolve_mysql_admin_url() -> str:
    url = os.environ.get("SAFE_TIME_TEST_MYSQL_URL", DEFAULT_MYSQL_URL)
    if mysql_ping(url):
        return url
    unavailable("MariaDB", "mariadb-server", f"{url.split('@')[-1]} did not answer")
    raise AssertionError("unreachable")


class MySQLDatabase:
    """A fresh MariaDB/MySQL database created for this test session and dropped at its end."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.name = f"safe_time_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._run(f"CREATE DATABASE `{self.name}` CHARACTER SET utf8mb4")
        parts = urlsplit(admin_url)
        self.url = urlunsplit((parts.scheme, parts.netloc, f"/{self.name}", parts.query, ""))

    def _run(self, statement: str) -> None:
        engine = _mysql_engine(self.admin_url)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(statement)
        finally:
            engine.dispose()

    def drop(self) -> None:
        try:
            self._run(f"DROP DATABASE IF EXISTS `{self.name}`")
        except Exception:
            pass


# --- RabbitMQ ------------------------------------------------------------------------------------
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def amqp_ping(url: str) -> bool:
    """True when an AMQP broker answers at ``url`` (a real connection, not just a TCP port)."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


#: Vhosts made by one ``rabbitmqctl`` call. Every call boots an Erlang VM (0.3-0.5 CPU-seconds); a
#: pytest process of ``make test`` takes about nine vhosts, and three calls a vhost (add, permissions,
#: delete) were 176 VMs and 56 CPU-seconds of a run (docs/benchmarks.md).
VHOST_BATCH = 4
_ACTING_USER = "safe-time-tests"


def _erlang_binary(text: str) -> str:
    return '<<"' + text + '">>'


def vhost_changes(create: Sequence[str], delete: Sequence[str]) -> str:
    """One Erlang expression for ``rabbitmqctl eval``: delete ``delete`` (one gone already is no
    error), then add ``create`` with every permission for ``guest``. A failed add is an error."""
    acting = _erlang_binary(_ACTING_USER)
    calls = [f"(catch rabbit_vhost:delete({_erlang_binary(name)}, {acting}))" for name in delete]
    for name in create:
        vhost = _erlang_binary(name)
        calls.append(f"ok = rabbit_vhost:add({vhost}, {acting})")
        calls.append(
            f'ok = rabbit_auth_backend_internal:set_permissions(<<"guest">>, {vhost}, '
            f'<<".*">>, <<".*">>, <<".*">>, {acting})'
        )
    return ", ".join([*calls, "ok"]) + "."


def change_vhosts(create: Sequence[str], delete: Sequence[str]) -> None:
    """Delete and add vhosts on the machine's RabbitMQ in one ``rabbitmqctl`` call."""
    try:
        _rabbitmqctl("eval", vhost_changes(create, delete))
    except subprocess.CalledProcessError:
        # A RabbitMQ whose internal functions differ: the documented commands, one call each.
        for name in delete:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _rabbitmqctl("delete_vhost", name)
        for name in create:
            _rabbitmqctl("add_vhost", name)
            _rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")


class RabbitVhost:
    """A vhost of its own on the machine's RabbitMQ, so nothing leaks between tests."""

    def __init__(self, base_url: str = DEFAULT_AMQP_URL) -> None:
        self.name = f"safe-time-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        parts = urlsplit(base_url)
        self.url = urlunsplit((parts.scheme, parts.netloc, "/" + self.name, "", ""))


class RabbitVhosts:
    """Vhosts of the machine's RabbitMQ handed out one per test: made :data:`VHOST_BATCH` at a time,
    the next batch while a test uses the last of one, in a thread of their own so no test waits on
    ``rabbitmqctl``; the vhosts tests gave back are deleted by the next batch's call and at
    :meth:`close`. Each test still gets a new, empty vhost of its own."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rabbit-vhosts")
        self._ready: list[RabbitVhost] = []
        self._ahead: Future[list[RabbitVhost]] | None = None
        self._given_back: list[RabbitVhost] = []

    def _make(self, delete: list[RabbitVhost]) -> list[RabbitVhost]:
        made = [RabbitVhost(self.base_url) for _ in range(VHOST_BATCH)]
        change_vhosts([vhost.name for vhost in made], [vhost.name for vhost in delete])
        return made

    def _make_ahead(self) -> None:
        delete, self._given_back = self._given_back, []
        self._ahead = self._calls.submit(self._make, delete)

    def take(self) -> RabbitVhost:
        """A new vhost; when it is the last one made, the next batch starts being made."""
        if not self._ready:
            if self._ahead is None:
                self._make_ahead()
            assert self._ahead is not None
            ahead, self._ahead = self._ahead, None
            self._ready = ahead.result()
        vhost = self._ready.pop()
        if not self._ready:
            self._make_ahead()
        return vhost

    def give_back(self, vhost: RabbitVhost) -> None:
        """``vhost`` is done with: the next ``rabbitmqctl`` call deletes it."""
        self._given_back.append(vhost)

    def close(self) -> None:
        """Delete every vhost made or given back, and wait for the pending call."""
        leftover = self._ready + self._given_back
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                leftover += ahead.result()
        self._calls.shutdown(wait=True)
        if leftover:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                change_vhosts([], [vhost.name for vhost in leftover])


def resolve_amqp_base() -> str:
    url = os.environ.get("SAFE_TIME_TEST_AMQP_URL", DEFAULT_AMQP_URL)
    if not amqp_ping(url):
        unavailable(f"RabbitMQ at {url}", "rabbitmq-server", "no AMQP answer")
    if not shutil.which("rabbitmqctl"):
        unavailable("rabbitmqctl", "rabbitmq-server", "needed to create a vhost per test")
    return url


def _rabbit_binary(name: str) -> str | None:
    # Debian's /usr/sbin wrappers switch to the rabbitmq user (and its HOME and cookie); the scripts
    # behind them run as whoever calls them, with the directories we give them.
    for candidate in (f"/usr/lib/rabbitmq/bin/{name}", shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class RabbitNode:
    """A RabbitMQ node of the tests' own on loopback ports, with its own data, logs, cookie and
    config: for settings and faults that must not touch the machine's shared server (a short
    ``consumer_timeout``, a memory alarm). About 4 s to start."""

    def __init__(self, base_dir: Path, *, consumer_timeout_ms: int | None = None, tick_ms: int = 1000) -> None:
        self.dir = base_dir
        self.port = free_port()
        self.dist_port = free_port()
        self.name = f"safe-time-{os.getpid()}-{uuid.uuid4().hex[:6]}@localhost"
        self.consumer_timeout_ms = consumer_timeout_ms
        self.tick_ms = tick_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}"

    def url(self, vhost: str = "/") -> str:
        return f"{self.base_url}//" if vhost == "/" else f"{self.base_url}/{vhost}"

    def _env(self) -> dict[str, str]:
        d = self.dir
        return {
            **os.environ,
            "HOME": str(d),  # the Erlang cookie of this node and of rabbitmqctl calls to it
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),  # not /etc's (it names the machine's node)
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def start(self) -> RabbitNode:
        server = _rabbit_binary("rabbitmq-server")
        if server is None or _rabbit_binary("rabbitmqctl") is None:
            unavailable("rabbitmq-server", "rabbitmq-server", "binary not found (a throwaway node is needed)")
        assert server is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rabbitmq-env.conf").write_text("")
        (self.dir / "enabled_plugins").write_text("[].\n")
        conf = [f"listeners.tcp.default = 127.0.0.1:{self.port}"]
        if self.consumer_timeout_ms is not None:
            conf.append(f"consumer_timeout = {self.consumer_timeout_ms}")
        (self.dir / "rabbitmq.conf").write_text("\n".join(conf) + "\n")
        # RabbitMQ checks consumer timeouts once per channel tick (a minute by default): tick faster.
        (self.dir / "advanced.config").write_text(f"[{{rabbit, [{{channel_tick_interval, {self.tick_ms}}}]}}].\n")
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [server], env=self._env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"RabbitMQ node {self.name} exited: {(self.dir / 'server.log').read_text()[-2000:]}")
            if amqp_ping(self.url()):
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"RabbitMQ node {self.name} did not start within 90 s")

    def ctl(self, *args: str) -> str:
        ctl = _rabbit_binary("rabbitmqctl")
        assert ctl is not None
        result = subprocess.run(
            [ctl, "-q", "-n", self.name, *args], env=self._env(), check=True, capture_output=True, text=True, timeout=60
        )
        return result.stdout

    def vhost(self) -> str:
        """A new vhost on this node; returns its URL."""
        name = f"v-{uuid.uuid4().hex[:8]}"
        self.ctl("add_vhost", name)
        self.ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        return self.url(name)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, 15)  # our own process group: the node and its port helpers
        except ProcessLookupError:
            return
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


# --- no Redis -------------------------------------------------------------------------------


@dataclass
class RedisWatch:
    """The evidence that a run used no Redis: every process started (and their children) is looked at
    now and then; none may be a ``redis-server`` or hold a TCP connection to the Redis port.

    It reads ``/proc`` (Linux): the process tree under the demo, each process's socket inodes, and the
    kernel's TCP tables (``/proc/net/tcp``, ``tcp6``) for their ports.
    """

    samples: int = 0
    most_processes: int = 0
    redis_processes: set[str] = field(default_factory=set)
    redis_connections: set[str] = field(default_factory=set)

    def sample(self, roots: Sequence[int] = ()) -> None:
        """Look at ``roots`` and their descendants (default: this process, e.g. the demo, which reads
        the results too, and everything it started)."""
        pids = [pid for root in (roots or [os.getpid()]) for pid in (root, *_descendants(root))]
        self.samples += 1
        self.most_processes = max(self.most_processes, len(pids))
        remote_port_of = _tcp_remote_ports()
        for pid in pids:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue  # gone meanwhile
            if comm.startswith("redis"):
                self.redis_processes.add(f"{comm} (pid {pid})")
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:[") and remote_port_of.get(target[8:-1]) == REDIS_DEFAULT_PORT:
                    self.redis_connections.add(f"{comm} (pid {pid})")

    @property
    def clean(self) -> bool:
        return self.samples > 0 and not self.redis_processes and not self.redis_connections


def _descendants(root: int) -> list[int]:
    """Every live process under ``root`` (not ``root`` itself), from ``/proc/*/stat``."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name sits in parentheses and may hold spaces: the ppid is the 2nd field after it.
        children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _tcp_remote_ports() -> dict[str, int]:
    """Socket inode -> remote port of every TCP socket of this network namespace."""
    ports: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                ports[fields[9]] = int(fields[2].rsplit(":", 1)[1], 16)
    return ports


# --- SQS ------------------------------------------------------------------------------------


class SqsEndpoint:
    """A local SQS-compatible endpoint (moto's server mode) on a free loopback port, owned by the
    session; queues of one test are kept apart by a ``queue_name_prefix`` of its own."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The broker URL: kombu takes the endpoint from its host and port (``is_secure`` False: http)."""
        return f"sqs://test:test@127.0.0.1:{self.port}"

    def start(self) -> SqsEndpoint:
        binary = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
        if binary is None:
            unavailable("moto_server", "(pip) moto[server], in the dev extra", "binary not found")
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                self.client().list_queues()
                return self
            except Exception:
                time.sleep(0.1)
        self.stop()
        unavailable("moto_server", "(pip) moto[server], in the dev extra", f"no answer on {self.endpoint}")
        return self

    def client(self) -> Any:
        """A boto3 SQS client on the endpoint."""
        import boto3

        return boto3.client(
            "sqs",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


#: Redis broker options for tests that kill or stall workers. kombu looks for unacked messages past
#: their ``visibility_timeout`` every second (by default every 100 s). Its restore scan holds a Redis
#: mutex that expires in 5 s (by default 300 s): a worker killed -9 during a scan keeps it until then,
#: and no worker restores anything meanwhile.
REDIS_FAST_RESTORE: dict[str, Any] = {
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": 5,
}


def sqs_transport_options(prefix: str, **extra: Any) -> dict[str, Any]:
    """kombu's SQS transport options for the local endpoint: a 10 s visibility timeout, short polls,
    and a queue name prefix of the test's own."""
    return {
        "region": "us-east-1",
        "is_secure": False,
        "visibility_timeout": 10,
        "wait_time_seconds": 1,
        "polling_interval": 0.2,
        "queue_name_prefix": prefix,
        **extra,
    }


def sqs_broker_url(endpoint: SqsEndpoint, prefix: str) -> str:
    """A broker URL on ``endpoint`` for queues named ``prefix...``: the prefix rides in the URL's path
    (kombu's SQS transport ignores the virtual host), so a test taking a broker URL alone can build
    the transport options it needs with :func:`broker_conf`."""
    return f"{endpoint.url}/{prefix}"


def broker_conf(broker_url: str, **transport: Any) -> dict[str, Any]:
    """The app settings a test's ``broker_url`` needs besides the URL: on SQS the transport options of
    :func:`sqs_transport_options` (the queue name prefix from the URL's path, ``transport`` on top);
    on Redis and RabbitMQ none."""
    if not broker_url.startswith("sqs://"):
        return {}
    prefix = urlsplit(broker_url).path.lstrip("/")
    return {"broker_transport_options": sqs_transport_options(prefix, **transport)}


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Terminate a server this module started (killed after 10 s), if it still runs."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
