"""Named SQL statements: the ``.sql`` files beside the modules that run them, read by one loader.

A line ``-- name: <name>`` begins a statement; any other line starting with ``--`` at column 0 is a
comment of the file (comments inside a statement are indented and sent with it, as PL/pgSQL bodies
keep theirs). Standard library only, so a store that never touches SQLAlchemy can read its statements.
"""

from __future__ import annotations

import functools
from importlib import resources

#: What begins a named statement.
NAME_PREFIX = "-- name: "


@functools.cache
def named_statements(package: str, resource: str) -> dict[str, str]:
    """The statements of ``resource`` (a path under ``package``, e.g. ``"sql/queries.sql"``) by name, in file order."""
    text = resources.files(package).joinpath(resource).read_text(encoding="utf-8")
    statements: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(NAME_PREFIX):
            current = statements[line[len(NAME_PREFIX) :].strip()] = []
        elif current is not None and not line.startswith("--"):
            current.append(line)
    return {name: "\n".join(body).strip() for name, body in statements.items()}
