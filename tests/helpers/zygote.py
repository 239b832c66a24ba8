"""Start ``celery`` processes by forking a process that has Celery's libraries imported already.

Each ``python -m celery -A app worker`` used to import Python's, Celery's, kombu's, redis-py's and
SQLAlchemy's modules afresh: about 0.6 CPU-seconds of a worker's 1.2-1.9 to ready, and the suite
starts hundreds. One zygote per pytest process imports those third-party modules once; a start forks
it, and the child sets its environment, working folder and log, then runs ``celery``'s own
``__main__`` with the arguments: the real command line code path. ``celery_safe_time`` and the test
apps are imported in the child, after its environment is set (settings read at import see the
test's values); ``celery.bin.celery`` is not preloaded either (it loads the ``celery.commands``
plugins, ``celery_safe_time.cli`` among them). A start whose environment changes a variable read at
the import of a preloaded module, or by the interpreter at start (``PYTHON*``), runs as a fresh
process instead (:func:`needs_fresh_interpreter`).

The zygote is the started processes' parent: it reaps them and writes each one's exit code and CPU
seconds back on the connection that asked for it (:class:`ForkedProcess` reads them, the CPU into
:data:`reaped_cpu` for ``SAFE_TIME_TEST_CPU_LOG``).

``ps`` shows a forked process with the zygote's command line (``python -m tests.helpers.zygote``):
its log (``<test tmp>/<name>.log``) says what it runs. ``SAFE_TIME_TEST_FRESH_PROCESSES=1`` starts
every process fresh (``subprocess.Popen``).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Imported once by the zygote. None of them reads a test's settings at import; see FRESH_ENV.
#: ``celery.bin.celery``'s own imports are here (its other commands, ``click_repl`` and the
#: ``prompt_toolkit`` it brings: 0.32 CPU-seconds of every start), not the module itself.
PRELOAD = (
    "celery",
    "celery.bin.base",
    "celery.bin.worker",
    "celery.bin.beat",
    "celery.bin.amqp",
    "celery.bin.call",
    "celery.bin.control",
    "celery.bin.events",
    "celery.bin.graph",
    "celery.bin.list",
    "celery.bin.logtool",
    "celery.bin.migrate",
    "celery.bin.multi",
    "celery.bin.purge",
    "celery.bin.result",
    "celery.bin.shell",
    "celery.bin.upgrade",
    "click_didyoumean",
    "click_plugins",
    "celery.apps.worker",
    "celery.apps.beat",
    "celery.worker",
    "celery.worker.consumer",
    "celery.concurrency.prefork",
    "celery.beat",
    "kombu.transport.redis",
    "kombu.transport.pyamqp",
    "redis",
    "sqlalchemy",
    "dateutil.rrule",
    "click",
)
#: Environment variables read by the interpreter at start or by a preloaded module at its import
#: (celery, kombu, billiard, OpenTelemetry through redis-py, the timezone): a start that changes one
#: gets a fresh interpreter.
FRESH_ENV = re.compile(
    r"^(PYTHON|C_|CELERY_|KOMBU_|MP_|OTEL_)|^(FORKED_BY_MULTIPROCESSING|REMAP_SIGTERM|PICKLE_PROTOCOL|TERM"
    r"|ITERM_PROFILE|USE_FAST_LOCALS|TIMER_DEBUG|DISABLE_TRACEBACKS|AUTOSCALE_KEEPALIVE|NO_WORKER"
    r"|WORKER_LOGLEVEL|SETUPTOOLS_USE_DISTUTILS)$"
)
#: Seconds of CPU (user + system) of the processes the zygote reaped for this pytest process.
reaped_cpu = 0.0


def fresh_processes() -> bool:
    return os.environ.get("SAFE_TIME_TEST_FRESH_PROCESSES", "") not in ("", "0")


def zygote_env() -> dict[str, str]:
    """The zygote's environment: this process's, as ``CeleryProcess`` extends it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env


def needs_fresh_interpreter(env: dict[str, str]) -> bool:
    """Whether ``env`` differs from the zygote's environment in a variable read before the fork."""
    base = zygote_env()
    changed = {key for key in env.keys() | base.keys() if env.get(key) != base.get(key)}
    return any(FRESH_ENV.match(key) for key in changed)


class ForkedProcess:
    """The part of ``subprocess.Popen`` the tests use, for a process the zygote started.

    Thread-safe as ``Popen`` is: the soak's fault injector, its supervisor and the test look at one
    process at once, and two readers of the socket would split the exit line or read it after the
    other closed the socket (``OSError: Bad file descriptor``). Like ``Popen.poll``, a poll while
    another thread waits says "still running"."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._reply = b""
        self._lock = threading.Lock()
        self.returncode: int | None = None
        self.pid = int(self._read_line(None))

    def _read_line(self, timeout: float | None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._reply:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(f"pid {getattr(self, 'pid', '?')}", timeout or 0) from None
            if not chunk:
                raise RuntimeError("the zygote closed the connection before the process ended")
            self._reply += chunk
        line, self._reply = self._reply.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._finish(0)
            except subprocess.TimeoutExpired:
                pass
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            try:
                if self.returncode is None:
                    self._finish(None if deadline is None else max(0.0, deadline - time.monotonic()))
            finally:
                self._lock.release()
        assert self.returncode is not None
        return self.returncode

    def _finish(self, timeout: float | None) -> None:
        global reaped_cpu
        code, cpu = self._read_line(timeout).split()
        self.returncode = int(code)
        reaped_cpu += float(cpu)
        self._conn.close()


class Zygote:
    """The client side: starts the zygote on first use (one per pytest process) and asks it for processes."""

    _lock = threading.Lock()
    _instance: Zygote | None = None

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="safe-time-zygote-")
        self.socket_path = os.path.join(self._dir, "zygote.sock")
        # its stdin is a pipe from this process: it exits when this process does
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote", self.socket_path],
            env=zygote_env(),
            stdin=subprocess.PIPE,
            cwd=str(ROOT),
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the process zygote did not start (exit code {self.proc.poll()})")
            time.sleep(0.02)

    @classmethod
    def get(cls) -> Zygote:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def start(
        self, args: list[str], env: dict[str, str], cwd: str, log_path: str, stderr_path: str | None = None
    ) -> ForkedProcess:
        """``celery ARGS`` with ``env`` in ``cwd``, its stdout (and stderr, unless ``stderr_path``)
        appended to ``log_path``."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket_path)
        request = {"args": args, "env": env, "cwd": cwd, "log": log_path, "stderr": stderr_path or log_path}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(conn)


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the process ``python -m celery ARGS`` would be, and run it."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["log"]), (2, request["stderr"])):
            log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, fd)
            os.close(log)
        os.chdir(request["cwd"])
        # `python -m` puts its working folder first on the path
        sys.path[0] = os.getcwd()
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        import celery.__main__

        sys.modules["__main__"] = celery.__main__
        sys.argv = [celery.__main__.__file__, *request["args"]]
        try:
            celery.__main__.main()
            code = 0
        except SystemExit as exit:
            # as the interpreter does with an uncaught SystemExit
            if exit.code is None:
                code = 0
            elif isinstance(exit.code, int):
                code = exit.code
            else:
                print(exit.code, file=sys.stderr)
                code = 1
        except BaseException:
            # as the interpreter does with any other uncaught exception (celery's stderr logger
            # takes the traceback in one write)
            sys.excepthook(*sys.exc_info())
            code = 1
        # what the interpreter does before it exits: join non-daemon threads, run atexit
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(socket_path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}

    def reap() -> None:
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is not None:
                cpu = usage.ru_utime + usage.ru_stime
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)} {cpu:.3f}\n".encode())
                except OSError:
                    pass
                conn.close()

    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                with conn.makefile("rb") as reader:
                    request = json.loads(reader.readline())
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for sock in (listener, conn, *children.values()):
                        sock.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    _run_child(request)
                children[pid] = conn
                conn.sendall(f"{pid}\n".encode())
            elif key.fileobj == wake_read:
                try:
                    while os.read(wake_read, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif not os.read(sys.stdin.fileno(), 4096):
                # The pytest process is gone. A process it started and did not stop (the session was
                # interrupted or killed) would keep consuming from the Redis databases and queues the
                # next run lends out: each child leads a session of its own, so its group goes with it.
                reap()
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                os.unlink(socket_path)
                os.rmdir(os.path.dirname(socket_path))
                return
        reap()


if __name__ == "__main__":
    serve(sys.argv[1])
