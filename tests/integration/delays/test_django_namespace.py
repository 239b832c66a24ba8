"""Django migration ``0003_store_namespace`` on a table with rows: they get the legacy namespace and
an app's store still claims them (issue 21, item 3)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from celery_safe_time import constants as C
from celery_safe_time.contrib.django.store import DjangoStore
from tests.helpers.delays import new_delay

pytestmark = pytest.mark.integration

APP = "celery_safe_time"
BEFORE = (APP, "0002_delivery_record")  # the migration under test, 0003_store_namespace, comes next


def _migrate(target: tuple[str, str] | None) -> None:
    """Migrate the app to ``target``; None: to its latest migration (what the model and later tests need)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    if target is None:
        [target] = [node for node in executor.loader.graph.leaf_nodes() if node[0] == APP]
    executor.migrate([target])


@pytest.mark.django_db(transaction=True)
def test_0003_gives_existing_rows_the_legacy_namespace_and_they_are_still_claimed() -> None:
    _migrate(BEFORE)
    try:
        columns = {c.name for c in connection.introspection.get_table_description(connection.cursor(), C.DELAY_TABLE)}
        assert "namespace" not in columns
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {C.DELAY_TABLE} (id, task, payload, content_type, content_encoding, due_at, status,"
                " attempts, created_at, updated_at, starts) VALUES (%s, %s, %s, %s, %s, now() - interval '1 second',"
                " 'pending', 0, now(), now(), 0)",
                ["from-before", "tests.delays.record", b"[[], {}, {}]", "application/json", "utf-8"],
            )
    finally:
        _migrate(None)  # through 0003 to the latest, which the model matches
    store = DjangoStore()
    store.namespace = "proj"
    row = store.get("from-before")
    assert row is not None
    assert row.namespace == ""
    [claimed] = store.claim_due(limit=5, lookahead=0, token="t")
    assert claimed.id == "from-before"
    other = DjangoStore()
    other.namespace = "shop"
    assert other.counts()[C.STATUS_CLAIMED] == 1  # legacy rows are every app's
    store.insert(new_delay("mine", store.now() + timedelta(hours=1)))
    assert other.get("mine") is None
