"""The SQL store's named statements: ``queries.sql`` and ``schema.sql``, package resources beside this module.

A leaf module (the standard library only): :mod:`..base` reads its clock queries here, and the SQL
modules theirs, without importing each other through the package.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def _named(resource: str) -> dict[str, str]:
    """The statements of ``resource`` by name: the text after each ``-- name:`` header, comments dropped."""
    text = resources.files(__name__.rpartition(".")[0]).joinpath(resource).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    named: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("--")]
        named[name] = "\n".join(lines).strip()
    return named


def query(name: str, resource: str = "queries.sql") -> str:
    """The SQL named ``name`` in ``resource`` (``queries.sql``: statements; ``schema.sql``: fragments)."""
    return _named(resource)[name]
