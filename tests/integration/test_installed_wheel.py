"""The package as users get it: a wheel built from the checkout's files, installed outside the checkout.

Every other test imports ``celery_safe_time`` from the source tree (an editable install), which
hides what the wheel leaves out. Here ``python -m build`` makes an sdist and the wheel from that
sdist, a fresh venv gets the wheel (its dependencies are the test environment's, through a ``.pth``
line: the wheel itself is the only copy of the package on that venv's path), and every process runs
from a temporary directory with the checkout off ``sys.path``: module imports, package data, a
stored delay swept and run by a real worker, a beat slot fired by ``celery beat -S
celery_safe_time.SafeScheduler``, an ``overlap_lock``, and a slice of the unit tests themselves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import redis

from tests.helpers import readme
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "celery_safe_time"
#: What the wheel must hold besides modules: the files the package reads at run time.
DATA_SUFFIXES = {".lua", ".html", ".sql"}
#: The unit tests run against the installed wheel: settings, key names, locks, payloads, slots and the
#: testing plugin (loaded through the wheel's pytest11 entry point) reach most modules of the package.
UNIT_SLICE = [
    "tests/unit/test_config.py",
    "tests/unit/test_key_names.py",
    "tests/unit/locks",
    "tests/unit/testing",
    "tests/unit/delays/test_payload.py",
    "tests/unit/beat/test_slots.py",
]


def _suite_copy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("suite_without_source", ROOT / "scripts" / "suite_without_source.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class Installed:
    """The built distributions and the venv the wheel is installed into."""

    base: Path
    wheel: Path
    sdist: Path
    build_log: str
    python: Path
    site_packages: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a user's process: no PYTHONPATH, no Django settings, no pytest worker state."""
        # SAFE_TIME_TEST_CPU_LOG: the pytest run inside would add its tests' lines to the outer run's log,
        # whose line for this test counts their CPU already
        drop = {"PYTHONPATH", "DJANGO_SETTINGS_MODULE", "PYTHONSTARTUP", "SAFE_TIME_TEST_CPU_LOG"}
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}
        return {**env, "PYTHONUNBUFFERED": "1", **extra}

    def run(self, cwd: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        """``<venv python> <args>`` in ``cwd``."""
        return subprocess.run(
            [str(self.python), *args], cwd=cwd, env=self.env(**env), capture_output=True, text=True, timeout=timeout
        )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    # The checkout's files as a clean clone has them (tracked and new, not ignored), uncommitted
    # edits included; building there leaves no build/ or egg-info in the checkout.
    _suite_copy().copy_suite(ROOT, source, package=True)
    build = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(base / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = _ok(build) + build.stderr
    (wheel,) = (base / "dist").glob("*.whl")
    (sdist,) = (base / "dist").glob("*.tar.gz")

    venv = base / "venv"
    _ok(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True))
    python = venv / "bin" / "python"
    _ok(
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    site_packages = Path(
        _ok(
            subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                capture_output=True,
                text=True,
            )
        ).strip()
    )
    # The dependencies (celery, kombu, redis, SQLAlchemy, Django, pytest ...) are this environment's:
    # a path line, after the venv's own site-packages, so the wheel's package comes first and the
    # editable install's import hook (a .pth of that directory) is never run.
    deps = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site_packages / "zz_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    return Installed(base, wheel, sdist, log, python, site_packages)


def _source_files() -> list[str]:
    return [
        str(path)
        for path in _suite_copy().project_files(ROOT, package=True)
        if path.parts[0] == PACKAGE and "__pycache__" not in path.parts
    ]


def _payload(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}


def test_the_wheel_built_from_the_sdist_holds_every_module_and_data_file_of_the_source_tree(
    installed: Installed,
) -> None:
    expected = {
        name
        for name in _source_files()
        if name.endswith(".py") or Path(name).suffix in DATA_SUFFIXES or name.endswith("py.typed")
    }
    shipped = _payload(installed.wheel)
    assert sorted(expected - shipped) == []
    assert sorted(shipped - expected) == []
    assert f"{PACKAGE}/py.typed" in shipped
    assert {n for n in shipped if "/migrations/0" in n}, "no Django migration in the wheel"
    # setuptools says so when a data folder is not a package it ships.
    assert "is absent from the `packages` configuration" not in installed.build_log
    assert "would be ignored" not in installed.build_log


def test_twine_accepts_the_wheel_and_the_sdist(installed: Installed) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(installed.wheel), str(installed.sdist)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


IMPORT_ALL = """
import importlib, importlib.resources, json, os, pkgutil, sys
import django
from django.conf import settings

# The Django app's modules (models, admin, migrations) need settings, as in a user's project.
settings.configure(
    INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.sessions", "django.contrib.messages", "django_celery_beat",
                    "celery_safe_time.contrib.django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
)
django.setup()
import celery_safe_time
from celery_safe_time import SafeTask, SafeScheduler, overlap_lock, idempotent, save_entry

names = [celery_safe_time.__name__]
for info in pkgutil.walk_packages(celery_safe_time.__path__, "celery_safe_time."):
    importlib.import_module(info.name)
    names.append(info.name)
files = importlib.resources.files("celery_safe_time")
data = sorted(
    str(p.relative_to(files)) for p in files.rglob("*")
    if p.is_file() and (p.suffix in DATA_SUFFIXES or p.name == "py.typed")
)
print(json.dumps({"file": celery_safe_time.__file__, "version": celery_safe_time.__version__,
                  "modules": names, "data": data, "path": [os.path.abspath(p) for p in sys.path]}))
"""


def test_every_module_and_data_file_loads_from_the_installed_wheel_with_the_checkout_off_sys_path(
    installed: Installed, tmp_path: Path
) -> None:
    script = f"DATA_SUFFIXES = {sorted(DATA_SUFFIXES)!r}\n{IMPORT_ALL}"
    report = json.loads(_ok(installed.run(tmp_path, "-c", script)).splitlines()[-1])
    assert Path(report["file"]).is_relative_to(installed.site_packages)
    assert not [p for p in report["path"] if (Path(p) / PACKAGE).resolve() == ROOT / PACKAGE]

    sources = _source_files()
    modules = {
        name[: -len(".py")].replace("/", ".").removesuffix(".__init__") for name in sources if name.endswith(".py")
    }
    assert sorted(modules - set(report["modules"])) == []
    data = {name.removeprefix(f"{PACKAGE}/") for name in sources if Path(name).suffix in DATA_SUFFIXES}
    assert set(report["data"]) == data | {"py.typed"}

    metadata = _ok(
        installed.run(tmp_path, "-c", "import importlib.metadata as m; print(m.version('celery-safe-time'))")
    )
    assert metadata.strip() == report["version"]


PROJECT = """
import os

import celery_safe_time
import redis
from celery import Celery
from celery_safe_time import overlap_lock

BROKER = os.environ["SMOKE_BROKER_URL"]
app = Celery("proj", broker=BROKER, task_cls="celery_safe_time:SafeTask")
app.conf.safe_time_store_url = os.environ["SMOKE_STORE_URL"]
app.conf.safe_time_delay_threshold = 2
app.conf.safe_time_sweep_interval = 1
app.conf.beat_schedule = {"tick": {"task": "proj.tick", "schedule": 1.0}}
celery_safe_time.install(app)

record = redis.Redis.from_url(BROKER)


@app.task(name="proj.remind")
def remind(n):
    # the package first: the test reads it as soon as it sees the run
    record.set("smoke:package", celery_safe_time.__file__)
    record.rpush("smoke:remind", n)


@app.task(name="proj.tick")
def tick():
    record.rpush("smoke:tick", 1)


@app.task(name="proj.locked")
@overlap_lock("smoke:{n}", on_conflict="raise")
def locked(n):
    record.rpush("smoke:locked", n)
"""

STORE_DELAY = """
from proj import remind
print(remind.apply_async((7,), countdown=4).id)
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project directory holding ``proj.py`` and nothing of the checkout."""
    directory = tmp_path / "proj"
    directory.mkdir()
    (directory / "proj.py").write_text(PROJECT)
    return directory


def _start(installed: Installed, project: Path, log: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(installed.python), "-m", "celery", "-A", "proj", *args],
            cwd=project,
            env=installed.env(PYTHONPATH=str(project), **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_a_stored_delay_a_beat_slot_and_an_overlap_lock_run_from_the_installed_wheel(
    installed: Installed, project: Path, tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    env = {"SMOKE_BROKER_URL": redis_url, "SMOKE_STORE_URL": f"sqlite:///{tmp_path / 'store.sqlite3'}"}
    task_id = _ok(installed.run(project, "-c", STORE_DELAY, PYTHONPATH=str(project), **env)).split()[-1]
    listing = _ok(installed.run(project, "-m", "celery", "-A", "proj", "safe-time", "delays", "list", **env))
    assert re.search(rf"^{task_id}\s+pending\b", listing, re.M), listing

    worker_log, beat_log = tmp_path / "worker.log", tmp_path / "beat.log"
    worker = _start(installed, project, worker_log, env, "worker", "-P", "threads", "-c", "2", "-l", "info")
    beat = _start(installed, project, beat_log, env, "beat", "-S", "celery_safe_time.SafeScheduler", "-l", "info")
    try:
        logs = lambda: f"worker:\n{worker_log.read_text()[-3000:]}\nbeat:\n{beat_log.read_text()[-3000:]}"  # noqa: E731
        wait_for(lambda: redis_client.llen("smoke:tick") >= 2, timeout=90, message=f"two beat ticks run\n{logs()}")
        wait_for(lambda: redis_client.lrange("smoke:remind", 0, -1) == [b"7"], timeout=60, message=logs())
        package = (redis_client.get("smoke:package") or b"").decode()
        assert Path(package).is_relative_to(installed.site_packages), package

        for n in (1, 2):  # the second run takes the key the first released
            _ok(
                installed.run(
                    project, "-c", f"from proj import locked; locked.delay({n})", PYTHONPATH=str(project), **env
                )
            )
            wait_for(lambda n=n: redis_client.llen("smoke:locked") == n, timeout=60, message=logs())
        assert redis_client.lrange("smoke:locked", 0, -1) == [b"1", b"2"]
    finally:
        readme.stop(beat)
        readme.stop(worker)
    assert "sweep: 1 claimed" in worker_log.read_text()
    assert f"Task proj.remind[{task_id}] succeeded" in worker_log.read_text()
    assert "Traceback" not in worker_log.read_text() + beat_log.read_text()


def test_a_slice_of_the_unit_tests_passes_against_the_installed_wheel(installed: Installed) -> None:
    suite = installed.base / "suite"
    _suite_copy().copy_suite(ROOT, suite)
    assert not (suite / PACKAGE).exists()
    result = installed.run(
        suite,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        *UNIT_SLICE,
        timeout=300,
        SAFE_TIME_TEST_INSTALLED="1",
    )
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert re.search(r"\d+ passed", tail), tail
