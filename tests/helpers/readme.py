"""Projects laid out exactly as the README's quick starts show, built in a temporary directory.

The code is taken from README.md itself (only the broker and store URLs are pointed at the test's
services), so a README change that breaks a new user's first hour breaks these tests too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.services import stop_process

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_BROKER = "redis://127.0.0.1:6379/0"
README_STORE = "postgresql://app@db/app"


def readme_block(section: str) -> str:
    """The first ```python block under the README heading ``## {section}``."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no python block under {section!r}"
    return match.group(1)


def _files(block: str) -> dict[str, str]:
    """``# proj/settings.py ...`` headers split one block into files."""
    files: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in block.splitlines():
        header = re.match(r"# (proj/[\w/]+\.py)\b", line)
        if header:
            current = files.setdefault(header.group(1), [])
            continue
        if current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip() + "\n" for name, lines in files.items()}


README_INSTALL = "celery_safe_time.install(app)"


def build_plain_project(
    directory: Path, *, broker_url: str, store_url: str, extra: str = "", before_install: str | None = None
) -> Path:
    """``proj.py`` from "Quick start: a plain Celery app", plus ``extra`` code (the user's tasks).

    ``before_install`` is code put on the line before ``install(app)`` (a setting the user adds).
    """
    code = readme_block("Quick start: a plain Celery app")
    assert README_BROKER in code, "the README quick start changed: update this helper"
    assert README_STORE in code, "the README quick start changed: update this helper"
    assert README_INSTALL in code, "the README quick start changed: update this helper"
    code = code.replace(README_BROKER, broker_url).replace(README_STORE, store_url)
    if before_install is not None:
        code = code.replace(README_INSTALL, before_install + "\n" + README_INSTALL)
    (directory / "proj.py").write_text(code + extra)
    return directory


README_AMQP_BROKER = "amqp://user:pass@rabbit:5672/vhost"
NO_REDIS_SECTION = "Quick start: RabbitMQ + PostgreSQL, no Redis"


def build_no_redis_project(directory: Path, *, broker_url: str, store_url: str, extra: str = "") -> Path:
    """``proj.py`` from "Quick start: RabbitMQ + PostgreSQL, no Redis", plus ``extra`` code."""
    code = readme_block(NO_REDIS_SECTION)
    assert README_AMQP_BROKER in code, "the README quick start changed: update this helper"
    assert README_STORE in code, "the README quick start changed: update this helper"
    (directory / "proj.py").write_text(
        code.replace(README_AMQP_BROKER, broker_url).replace(README_STORE, store_url) + extra
    )
    return directory


def build_django_project(directory: Path, *, broker_url: str, extra_settings: str = "") -> Path:
    """``django-admin startproject proj`` plus the files of "Quick start: Django", as a user does."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "django", "startproject", "proj", str(directory)], check=True)
    files = _files(readme_block("Quick start: Django"))
    assert set(files) == {"proj/settings.py", "proj/celery.py", "proj/__init__.py"}, sorted(files)
    settings = directory / "proj" / "settings.py"
    added = files.pop("proj/settings.py").replace(README_BROKER, broker_url)
    settings.write_text(settings.read_text() + "\n" + added + extra_settings)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def _run(directory: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH"}}
    env["PYTHONPATH"] = str(directory)
    return subprocess.run(argv, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout)


def run(directory: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` in the project directory, as a user runs it from there."""
    return _run(directory, [sys.executable, "-m", *args], timeout)


def python(directory: Path, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c <code>`` in the project directory (what a user's own code does)."""
    return _run(directory, [sys.executable, "-c", code], timeout)


def celery(directory: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``celery -A proj <args>`` in the project directory."""
    return run(directory, "celery", "-A", "proj", *args, timeout=timeout)


def start(directory: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``celery -A proj <args>`` in the background, its output in ``log``; the caller kills it."""
    env = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH"}}
    env["PYTHONPATH"] = str(directory)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj", *args],
            cwd=directory,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s: one process, by its own handle."""
    stop_process(proc)
