"""The public names are typed for users' mypy (issue 21, item 7).

``celery_safe_time`` exports lazily (``__getattr__``), which mypy sees as ``Any`` unless every lazy
name is also imported under ``TYPE_CHECKING``. The first test runs ``mypy --strict`` over a sample
user module, as a user's CI would; the second keeps ``_LAZY``, ``__all__`` and the
``TYPE_CHECKING`` imports in step, so a name added later is typed too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args

import celery_safe_time
from celery_safe_time import constants as C

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
from celery import Celery

import celery_safe_time
from celery_safe_time import EntryInfo, SafeTimeConfig, idempotent, install, list_entries, overlap_lock

app = Celery("proj", task_cls="celery_safe_time:SafeTask")
config: SafeTimeConfig = install(app)


@overlap_lock("sync:{account_id}", ttl=60, on_conflict="skip", on_backend_error="raise")
def sync(account_id: int) -> int:
    return account_id


@idempotent("invoice:{tenant}", window=3600, on_conflict="retry")
def invoice(tenant: str) -> str:
    return tenant


synced: int = sync(1)
invoiced: str = invoice("acme")
entries: list[EntryInfo] = list_entries(app)
fence: int | None = celery_safe_time.locks.overlap.current_fence()
"""

BAD = """
from celery_safe_time import overlap_lock, idempotent


@overlap_lock(123, on_conflict="explode")
def sync(account_id: int) -> int:
    return account_id


@idempotent("k", on_backend_error="ignore")
def once() -> None: ...


wrong: str = sync(1)
"""


def _mypy(tmp_path: Path, *files: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "mypy.ini"
    # celery ships no types (as for any user of it). Our package is found from the checkout, where
    # mypy would check it under the user's flags: errors inside it are silenced, as mypy does for an
    # installed package (the package's own strict check is ``make type``).
    config.write_text(
        f"[mypy]\nstrict = True\nmypy_path = {ROOT}\ncache_dir = {tmp_path / 'cache'}\n"
        "[mypy-celery.*,kombu.*,billiard.*,vine.*,django.*,django_celery_beat.*]\nignore_missing_imports = True\n"
        "[mypy-celery_safe_time.*]\nignore_errors = True\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), *files],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


def test_mypy_strict_accepts_correct_use_and_rejects_bad_policies(tmp_path: Path) -> None:
    (tmp_path / "good_user.py").write_text(GOOD)
    (tmp_path / "bad_user.py").write_text(BAD)
    result = _mypy(tmp_path, "good_user.py", "bad_user.py")
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    good = [line for line in errors if line.startswith("good_user.py")]
    bad = [line for line in errors if line.startswith("bad_user.py")]
    assert good == [], result.stdout
    assert any(":5:" in line and "'explode'" in line for line in bad), result.stdout
    assert any(":5:" in line and '"int"' in line for line in bad), result.stdout  # 123 is no key
    assert any(":10:" in line and "'ignore'" in line for line in bad), result.stdout
    assert any(":14:" in line and "Incompatible types in assignment" in line for line in bad), result.stdout
    assert result.returncode == 1


def test_type_checking_imports_match_the_lazy_exports() -> None:
    tree = ast.parse(Path(celery_safe_time.__file__).read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                for alias in stmt.names:
                    typed[alias.asname or alias.name] = "." * stmt.level + (stmt.module or "")
    assert typed == celery_safe_time._LAZY
    eager = {name for name in celery_safe_time.__all__ if name not in celery_safe_time._LAZY}
    assert all(name in vars(celery_safe_time) for name in eager)
    assert set(celery_safe_time._LAZY) <= set(celery_safe_time.__all__)


def test_literal_policy_types_match_the_runtime_checks() -> None:
    assert set(get_args(C.OnConflict)) == C.ON_CONFLICT_POLICIES
    assert set(get_args(C.OnBackendError)) == C.ON_BACKEND_ERROR_POLICIES
