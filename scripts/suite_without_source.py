"""Copy the checkout without the package's source, to run the test suite against an installed wheel.

    python scripts/suite_without_source.py CHECKOUT TARGET

TARGET gets the project's files (git's tracked and untracked-but-not-ignored files, or the tree
without caches when CHECKOUT is no git checkout) except ``celery_safe_time/``: tests, docs, README and
setup.cfg (pytest's configuration) are where the tests look for them, and ``import celery_safe_time``
run from TARGET can only find the installed package. tox (``make compat``) and
tests/integration/test_installed_wheel.py run the suite from such a copy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "celery_safe_time"
#: Never copied when the checkout is not a git one (the same as .gitignore's, plus the VCS and tox).
SKIPPED = {".git", ".tox", ".venv", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache", ".hypothesis"}


def project_files(checkout: Path, *, package: bool = False) -> list[Path]:
    """The checkout's files as relative paths; the package's source only with ``package``."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=checkout,
            capture_output=True,
            check=True,
        ).stdout.decode()
        files = [Path(name) for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [
            path.relative_to(checkout)
            for path in checkout.rglob("*")
            if path.is_file() and not SKIPPED & set(path.relative_to(checkout).parts)
        ]
    return [
        f
        for f in files
        if (package or f.parts[0] != PACKAGE) and not any(part.endswith(".egg-info") for part in f.parts)
    ]


def copy_suite(checkout: Path, target: Path, *, package: bool = False) -> None:
    """Fill ``target`` with the checkout's files, ``celery_safe_time/`` only with ``package`` (what it held goes)."""
    # Emptied, not removed: it may be the current directory of the caller (tox's changedir).
    for old in target.iterdir() if target.exists() else ():
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for relative in project_files(checkout, package=package):
        source = checkout / relative
        if not source.is_file():  # deleted but not yet committed
            continue
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / relative)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    copy_suite(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
