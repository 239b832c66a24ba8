"""docs/migrating.md (issue 21, "Add"): every test it cites as "tried end to end" exists, and the
commands it shows are real ``celery safe-time`` subcommands and scheduler paths."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "migrating.md"


def _cited_tests() -> list[tuple[str, str]]:
    return re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", GUIDE.read_text())


def test_the_guide_covers_both_migrations() -> None:
    text = GUIDE.read_text()
    assert "## From celery-redbeat" in text
    assert "## From django-celery-beat's DatabaseScheduler" in text
    files = {path for path, _ in _cited_tests()}
    assert "tests/integration/first_hour/test_migrate_redbeat.py" in files
    assert "tests/integration/beat/test_django.py" in files


@pytest.mark.parametrize(("path", "name"), _cited_tests())
def test_every_cited_test_exists(path: str, name: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize(
    "dotted",
    ["celery_safe_time.SafeScheduler", "celery_safe_time.contrib.django.SafeDatabaseScheduler"],
)
def test_the_scheduler_paths_import(dotted: str) -> None:
    assert f"-S {dotted}" in GUIDE.read_text()
    module, _, attr = dotted.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is not None


def test_the_commands_exist() -> None:
    from celery_safe_time.cli import safe_time

    beat = safe_time.commands["beat"]
    for sub in re.findall(r"safe-time beat ([a-z-]+)", GUIDE.read_text()):
        assert sub in beat.commands, sub  # type: ignore[attr-defined]
