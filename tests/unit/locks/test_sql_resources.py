"""The PostgreSQL lock backend's SQL ships as named statements in ``locks/sql/*.sql`` (no services)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from celery_safe_time.locks.backends import postgres, postgres_sql
from celery_safe_time.sql.named import named_statements


def test_every_sql_file_of_locks_is_read_by_the_backend() -> None:
    shipped = {p.name for p in resources.files("celery_safe_time.locks").joinpath("sql").iterdir()}
    assert shipped == {"schema.sql", "queries.sql"}


def test_the_schema_makes_the_tables_then_the_sequence_then_the_functions_the_queries_call() -> None:
    schema = named_statements("celery_safe_time.locks", "sql/schema.sql")
    assert tuple(schema.values()) == postgres_sql.SCHEMA
    names = list(schema)
    assert names.index("lock") < names.index("fence") < names.index("take")
    created = " ".join(schema.values())
    assert names.index("rate") < names.index("rate_admit")
    for table in (
        "safe_time_lock",
        "safe_time_lock_marker",
        "safe_time_unique",
        "safe_time_lock_boot",
        "safe_time_rate",
    ):
        assert f"CREATE TABLE IF NOT EXISTS {table} (" in created
    called = set(re.findall(r"\b(safe_time_\w+)\(", " ".join(postgres_sql.QUERIES.values())))
    assert called == {
        "safe_time_lock_take",
        "safe_time_lock_give_back",
        "safe_time_lock_commit_marker",
        "safe_time_unique_claim",
        "safe_time_rate_admit",
    }
    for function in called:
        assert f"CREATE OR REPLACE FUNCTION {function}(" in created


def test_the_schema_creates_only_functions_that_a_query_or_another_function_calls() -> None:
    schema = " ".join(named_statements("celery_safe_time.locks", "sql/schema.sql").values())
    created = set(re.findall(r"CREATE OR REPLACE FUNCTION (safe_time_\w+)\(", schema))
    queries = " ".join(postgres_sql.QUERIES.values())
    called = {name for name in created if re.search(rf"\b{name}\(", queries) or re.search(rf"PERFORM {name}\(", schema)}
    assert created == called


def test_a_function_keeps_its_indented_comments_and_the_file_comments_are_dropped() -> None:
    schema = named_statements("celery_safe_time.locks", "sql/schema.sql")
    assert "-- Our own token (a lost reply)" in schema["take"]
    assert not any(line.startswith("--") for sql in schema.values() for line in sql.splitlines())
    assert all(sql and not sql.endswith(";") for sql in schema.values())


def test_every_named_query_is_run_by_the_backend_and_the_backend_builds_no_sql_of_its_own() -> None:
    backend = Path(postgres.__file__).read_text(encoding="utf-8")
    install = Path(postgres_sql.__file__).read_text(encoding="utf-8")
    used = set(re.findall(r'(?:QUERIES|_SQL)\["(\w+)"\]', backend + install))
    used |= set(re.findall(r'"(purge_\w+)"', backend))
    assert used == set(postgres_sql.QUERIES)
    assert all(sql and not sql.endswith(";") for sql in postgres_sql.QUERIES.values())
    assert not re.search(r"\b(SELECT|DELETE|UPDATE|INSERT|CREATE)\b", backend.split('"""', 2)[2])
