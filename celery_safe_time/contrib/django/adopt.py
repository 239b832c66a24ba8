"""The migration operation that adopts the plain store's table: a project that started with
``safe_time_store_url = "postgresql://..."`` (the SQLAlchemy store made ``celery_safe_time_delay``, its
columns and its indexes) and then installs the Django app keeps its table and its pending rows.

:class:`CreateModel` does what Django's does, unless the database already has the table: then it
changes nothing there, and Django records the state as usual. Going backwards is Django's own operation.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import migrations

logger = logging.getLogger(__name__)

__all__ = ["CreateModel"]


def _table_exists(schema_editor: Any, table: str) -> bool:
    with schema_editor.connection.cursor() as cursor:
        return table in schema_editor.connection.introspection.table_names(cursor)


class CreateModel(migrations.CreateModel):
    """``CreateModel`` that keeps a table of the same name made by the plain store (and its rows)."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = to_state.apps.get_model(app_label, self.name)
        table = model._meta.db_table
        if self.allow_migrate_model(schema_editor.connection.alias, model) and _table_exists(schema_editor, table):
            logger.info("table %s already exists (made by the plain store): adopted with its rows", table)
            return
        super().database_forwards(app_label, schema_editor, from_state, to_state)
