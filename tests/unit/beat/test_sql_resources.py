"""The PostgreSQL beat backend's SQL ships as named statements in ``beat/sql/*.sql``."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from celery_safe_time.beat.backends import postgres, postgres_reads
from celery_safe_time.sql.named import named_statements


def test_every_sql_file_of_beat_is_read_by_the_backend() -> None:
    shipped = {p.name for p in resources.files("celery_safe_time.beat").joinpath("sql").iterdir()}
    assert shipped == {"schema.sql", "queries.sql"}


def test_the_schema_creates_every_table_the_backend_names_in_order_lease_first() -> None:
    schema = named_statements("celery_safe_time.beat", "sql/schema.sql")
    assert next(iter(schema)) == "lease"
    tables = [getattr(postgres, name) for name in dir(postgres) if name.endswith("_TABLE")]
    created = " ".join(schema.values())
    for table in tables:
        assert f"CREATE TABLE IF NOT EXISTS {table} (" in created
    assert tuple(schema.values()) == postgres.DDL


def test_a_named_statement_keeps_its_indented_comments_and_drops_the_files() -> None:
    schema = named_statements("celery_safe_time.beat", "sql/schema.sql")
    assert "-- most updates" in schema["counts_function"]
    assert not any(line.startswith("--") for sql in schema.values() for line in sql.splitlines())


def test_every_query_the_backend_runs_is_named_in_queries_sql_and_every_named_one_is_run() -> None:
    queries = named_statements("celery_safe_time.beat", "sql/queries.sql")
    source = "".join(Path(m.__file__).read_text(encoding="utf-8") for m in (postgres, postgres_reads))
    used = set(re.findall(r'_QUERIES\["(\w+)"\]', source))
    assert used == set(queries)
    assert all(sql and not sql.endswith(";") for sql in queries.values())


def test_the_schema_check_names_every_object_the_schema_makes() -> None:
    """``ensure_tables`` runs no DDL when ``schema_present`` finds these: one missing from the list
    would leave a new table or index uncreated on a database that has the others."""
    made = "\n".join(postgres_reads.DDL)
    objects = postgres_reads.SCHEMA_OBJECTS
    assert len(re.findall(r"\bCREATE (?:TABLE|INDEX|FUNCTION|TRIGGER)\b", made)) == sum(
        len(objects[kind]) for kind in ("relations", "functions", "triggers")
    )
    assert "ALTER TABLE" not in made  # the tables are created whole: nothing was released before them
    assert len(objects["triggers"]) == len(objects["trigger_tables"])
