"""Launch real ``celery worker`` / ``celery beat`` subprocesses and send them signals."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.zygote import ForkedProcess, Zygote, fresh_processes, needs_fresh_interpreter

ROOT = Path(__file__).resolve().parents[2]


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.1, message: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; generous timeouts keep CI stable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        time.sleep(interval)


class CeleryProcess:
    """One ``python -m celery -A APP <args>`` process with its log in a file.

    ``env`` is added to the current environment; the test app modules under ``tests/apps`` read
    their settings from ``SAFE_TIME_TEST_*`` variables.
    """

    def __init__(self, app: str, args: Sequence[str], env: dict[str, str], log_dir: Path, name: str) -> None:
        self.app = app
        self.args = list(args)
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.log_path = log_dir / f"{name}.log"
        self.name = name
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None

    def start(self) -> CeleryProcess:
        args = ["-A", self.app, *self.args]
        if not fresh_processes() and not needs_fresh_interpreter(self.env):
            # a fork of a process with Celery's libraries imported runs `celery` (tests/helpers/zygote.py)
            self.proc = Zygote.get().start(args, self.env, str(self.log_path.parent), str(self.log_path))
            return self
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(self.log_path.parent),
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        """Signal the whole process group (a worker's pool children too)."""
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        self.wait(30)

    def pause(self) -> None:
        self.send(signal.SIGSTOP)

    def resume(self) -> None:
        self.send(signal.SIGCONT)

    def terminate(self, timeout: float = 30) -> int | None:
        """Warm shutdown: SIGTERM to the main process only (a worker then finishes its running tasks
        and stops its pool children itself; SIGTERM to the whole group killed children mid-task)."""
        self.send(signal.SIGCONT)
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode if self.proc else None

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is None:
            return None
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            if not self.alive() and not regex.search(self.log()):
                raise AssertionError(
                    f"{self.name} exited ({self.proc and self.proc.returncode}):\n{self.log()[-4000:]}"
                )
            return regex.search(self.log())

        return wait_for(found, timeout, message=f"{pattern!r} in {self.name} log")  # type: ignore[no-any-return]


class ProcessManager:
    """Starts processes for one test and makes sure none outlives it."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: list[CeleryProcess] = []

    def _spawn(self, app: str, args: Sequence[str], name: str, env: dict[str, str] | None) -> CeleryProcess:
        proc = CeleryProcess(app, args, {**self.env, **(env or {})}, self.log_dir, name)
        self.procs.append(proc)
        return proc.start()

    def worker(
        self,
        app: str = "tests.apps.basic",
        *extra: str,
        name: str | None = None,
        env: dict[str, str] | None = None,
        concurrency: int = 2,
        pool: str = "prefork",
    ) -> CeleryProcess:
        name = name or f"worker{len(self.procs)}"
        args = [
            "worker",
            "-l",
            "INFO",
            "-n",
            f"{name}@%h",
            "-c",
            str(concurrency),
            "-P",
            pool,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *extra,
        ]
        return self._spawn(app, args, name, env)

    def beat(
        self,
        app: str = "tests.apps.basic",
        *extra: str,
        name: str | None = None,
        env: dict[str, str] | None = None,
        scheduler: str = "celery_safe_time.SafeScheduler",
    ) -> CeleryProcess:
        name = name or f"beat{len(self.procs)}"
        schedule_file = str(self.log_dir / f"{name}-schedule")
        args = ["beat", "-l", "DEBUG", "-S", scheduler, "-s", schedule_file, "--max-interval", "1", *extra]
        return self._spawn(app, args, name, env)

    def command(
        self, app: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        argv = ["-A", app, *args]
        if not fresh_processes() and not needs_fresh_interpreter(full_env):
            return _forked_command(argv, full_env, self.log_dir, timeout)
        return subprocess.run(
            [sys.executable, "-m", "celery", *argv],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(self.log_dir),
        )

    def cli(self, app: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """What :meth:`command` returns, run in this process (:func:`tests.helpers.cli.run_celery`): for
        the commands a test only reads the output and exit code of (no signal, no concurrency)."""
        from tests.helpers.cli import run_celery

        return run_celery(app, *args, env={**self.env, **(env or {})}, cwd=self.log_dir)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.send(signal.SIGCONT)
                proc.send(signal.SIGKILL)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()[-6000:]}" for p in self.procs)


def _forked_command(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` of ``celery ARGV``,
    forked by the zygote: its output goes to two files that are read once it has ended."""
    fd, out_path = tempfile.mkstemp(prefix="command-", suffix=".out", dir=cwd)
    os.close(fd)
    fd, err_path = tempfile.mkstemp(prefix="command-", suffix=".err", dir=cwd)
    os.close(fd)
    proc = Zygote.get().start(argv, env, str(cwd), out_path, stderr_path=err_path)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise
    finally:
        out, err = Path(out_path), Path(err_path)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
    return subprocess.CompletedProcess([sys.executable, "-m", "celery", *argv], code, stdout, stderr)


#: Where a failed test's process logs and records are copied: pytest's temporary folders are pruned
#: after three runs and sit under a per-user path nobody finds from a CI log.
FAILURE_DIR = ROOT / "test-failures"


def keep_failure_files(request: pytest.FixtureRequest, log_dir: Path) -> Path:
    """Copy ``log_dir`` (worker and beat logs, a soak's ``records/``) to ``test-failures/<test>``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid).strip("_")[-150:]
    target = FAILURE_DIR / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(log_dir, target, ignore=shutil.ignore_patterns("*.sock", "*.pid"), dirs_exist_ok=True)
    return target


@contextlib.contextmanager
def managed_processes(request: pytest.FixtureRequest, log_dir: Path, env: dict[str, str]) -> Iterator[ProcessManager]:
    """A :class:`ProcessManager` for one test: everything killed at the end, the logs printed when
    the test failed (the ``processes`` fixture; a test that must not touch its Redis uses it directly)."""
    manager = ProcessManager(log_dir, env)
    try:
        yield manager
    finally:
        manager.stop_all()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(manager.logs())
            print(f"this test's logs and records are kept in {keep_failure_files(request, log_dir)}")
