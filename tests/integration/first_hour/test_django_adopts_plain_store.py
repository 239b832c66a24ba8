"""Issue 40, trap 1: a project that started on the plain store (``safe_time_store_url =
"postgresql://..."``) adds the Django app: ``manage.py migrate`` adopts the table and its rows, and the
store moves to ``"django"`` with nothing lost. The README's Django project, the real ``django`` and
``celery`` commands, a PostgreSQL database of its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from celery_safe_time import constants as C
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from tests.helpers import readme, services
from tests.helpers.delays import new_delay

pytestmark = pytest.mark.integration


@pytest.fixture
def database() -> Iterator[str]:
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    yield db.url
    db.drop()


def _django_settings(url: str) -> str:
    parts = urlsplit(url)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }
    return f"\nDATABASES = {{'default': {database!r}}}\n"


def test_migrate_adopts_the_plain_stores_table_and_rows(tmp_path: Path, redis_url: str, database: str) -> None:
    # The plain store's table, as `safe_time_store_url = "postgresql://..."` made it, with a pending row
    # of the project's app (namespace "proj") and a legacy one.
    plain = SQLAlchemyStore(database.replace("postgresql://", "postgresql+psycopg://", 1))
    plain.namespace = "proj"
    plain.ensure_schema()
    due = plain.now() + timedelta(days=14)
    plain.insert(new_delay("kept-1", due, task="proj.remind"))
    plain.insert(new_delay("kept-2", due + timedelta(hours=1), task="proj.remind"))
    plain.close()

    project = readme.build_django_project(
        tmp_path / "site", broker_url=redis_url, extra_settings=_django_settings(database)
    )
    migrated = readme.run(project, "django", "migrate", "--settings=proj.settings")
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr  # was: relation ... already exists
    assert "Applying celery_safe_time.0001_initial... OK" in migrated.stdout

    listing = readme.celery(project, "safe-time", "delays", "list", "--json")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    rows = json.loads(listing.stdout)
    assert [(r["id"], r["status"]) for r in rows] == [("kept-1", C.STATUS_PENDING), ("kept-2", C.STATUS_PENDING)]
    shown = json.loads(readme.celery(project, "safe-time", "delays", "show", "kept-1").stdout)
    assert shown["call"]["args"] == ["kept-1"]

    # The Django store now works on the adopted table: new rows, reschedule, a sweep claims what is due.
    store_one = readme.celery(project, "safe-time", "delays", "reschedule", "kept-1", "--countdown", "0")
    assert store_one.returncode == 0, store_one.stdout + store_one.stderr
    swept = readme.celery(project, "safe-time", "sweep")
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert json.loads(swept.stdout)["claimed"] == 1
    engine = sa.create_engine(database.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.connect() as conn:
        count = conn.execute(sa.text(f"SELECT count(*) FROM {C.DELAY_TABLE}")).scalar_one()
    engine.dispose()
    assert count == 2
    # And backwards (a rollback of the app) is Django's own: the table goes.
    back = readme.run(project, "django", "migrate", "celery_safe_time", "zero", "--settings=proj.settings")
    assert back.returncode == 0, back.stdout + back.stderr
