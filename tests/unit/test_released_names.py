"""0.9.0 is the first release: the package carries no names kept for earlier, unreleased versions."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import celery_safe_time

ROOT = Path(celery_safe_time.__file__).parent


def test_no_module_of_the_package_warns_of_a_deprecation() -> None:
    warning = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "DeprecationWarning" in p.read_text()]
    assert warning == []


@pytest.mark.parametrize(
    "module",
    ["celery_safe_time.tracing", "celery_safe_time.delays.stores", "celery_safe_time.locks.store"],
)
def test_the_pre_release_module_paths_do_not_import(module: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)
