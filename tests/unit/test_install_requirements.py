"""What ``pip install celery-safe-time`` declares covers what its Redis path imports (issue 21, item 5).

``pip install celery-safe-time[postgres]`` then ``celery beat`` died with ``No module named
'packaging'``: kombu's Redis transport imports it, and only ``kombu[redis]`` declares it. This test
walks the declared requirements of ``setup.cfg`` through the installed distributions' metadata (the
closure a fresh ``pip install`` would pull) and checks every third-party import of the Redis
transport and result backend is provided by a distribution in it. The real fresh-venv install is
``test_fresh_venv_install`` (marked slow: it downloads).
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
#: Modules a Redis broker / result backend / our leases load in every process.
REDIS_PATH_MODULES = ["kombu.transport.redis", "celery.backends.redis", "celery_safe_time.redis_client"]
README_EXTRAS = ["postgres", "mysql", "django"]


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def _requirements(text: str) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line]


def declared(*extras: str) -> list[Requirement]:
    cfg = _setup_cfg()
    found = _requirements(cfg["options"]["install_requires"])
    for extra in extras:
        found += _requirements(cfg["options.extras_require"][extra])
    return found


def closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of every distribution pip would install for ``requirements``."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        node = (canonicalize_name(req.name), frozenset(req.extras))
        if node in seen:
            continue
        seen.add(node)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here, so it cannot provide anything checked below
        for line in dist.requires or []:
            dep = Requirement(line)
            wanted = dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *req.extras))
            if wanted:
                dep.marker = None
                todo.append(dep)
    return {name for name, _ in seen}


def third_party_imports(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    own = module.split(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in (own, "__future__")}


def import_providers(names: set[str]) -> dict[str, list[str]]:
    """Top-level import name -> the distributions that install it, for ``names``.

    ``packages_distributions`` reads only ``top_level.txt`` on Python 3.10, which wheels built without
    setuptools (redis-py's) lack: a name it does not know comes from the files each distribution
    installed (a walk over every installed file: seconds of CPU, so only when needed).
    """
    providers = {
        name: list(dists) for name, dists in importlib.metadata.packages_distributions().items() if name in names
    }
    unknown = names - providers.keys()
    if not unknown:
        return providers
    for dist in importlib.metadata.distributions():
        for file in dist.files or []:
            top = file.parts[0]
            if file.suffix == ".py" or (len(file.parts) > 1 and not top.endswith((".dist-info", ".data", ".."))):
                name = top.removesuffix(".py")
                if name in unknown and dist.metadata["Name"] not in providers.setdefault(name, []):
                    providers[name].append(dist.metadata["Name"])
    return providers


@pytest.mark.parametrize("module", REDIS_PATH_MODULES)
def test_declared_requirements_cover_the_redis_path_imports(module: str) -> None:
    installed = closure(declared())
    imported = third_party_imports(module)
    providers = import_providers(imported)
    missing = {}
    for name in sorted(imported):
        dists = {canonicalize_name(d) for d in providers.get(name, [])}
        if name in ("celery", "kombu", "celery_safe_time"):
            continue
        if not dists & installed:
            missing[name] = sorted(dists) or ["(not installed here)"]
    assert not missing, f"{module} imports {missing}, which install_requires does not pull in"


def test_readme_install_section_names_only_real_extras() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r'pip install "?celery-safe-time(?:\[([a-z,]+)\])?"?', section)
    extras = {e for group in lines for e in group.split(",") if e}
    assert set(README_EXTRAS) <= extras
    assert extras <= set(_setup_cfg()["options.extras_require"])
    assert "" in lines  # the plain install (Redis or RabbitMQ broker) has its own line


def test_check_warns_about_a_celery_and_kombu_pair_of_different_series() -> None:
    # Issue 40, trap 8: pip put kombu 5.7 beside Celery 5.4; the tested pairs are of one series.
    from celery_safe_time.checks import version_pairing

    assert version_pairing("5.4.0", "5.4.3").status == "ok"
    mixed = version_pairing("5.4.0", "5.7.0")
    assert mixed.status == "warn"
    assert mixed.name == "versions"
    assert "pip install 'kombu==5.4.*'" in mixed.detail


def test_readme_names_the_tested_pairs_and_the_pin_tox_uses() -> None:
    readme = (ROOT / "README.md").read_text()
    assert '"celery==5.4.*" "kombu==5.4.*"' in readme
    tox = (ROOT / "tox.ini").read_text()
    for series in ("5.4", "5.5", "5.6", "5.7"):
        factor = "celery" + series.replace(".", "")
        upper = f"{series.split('.')[0]}.{int(series.split('.')[1]) + 1}"
        assert f"{factor}: celery>={series},<{upper}" in tox
        assert f"{factor}: kombu>={series},<{upper}" in tox
