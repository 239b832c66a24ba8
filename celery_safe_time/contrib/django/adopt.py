"""Migration operations that adopt the plain store's table: a project that started with
``safe_time_store_url = "postgresql://..."`` (the SQLAlchemy store made ``celery_safe_time_delay``, its
columns and its indexes) and then installs the Django app keeps its table and its pending rows.

Each operation does what Django's does, unless the database already has what it would create (the
table, the column, the index by name): then it changes nothing there, and Django records the state
as usual. Going backwards is Django's own operation.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import migrations

logger = logging.getLogger(__name__)

__all__ = ["AddField", "AddIndex", "CreateModel"]


def _table_exists(schema_editor: Any, table: str) -> bool:
    with schema_editor.connection.cursor() as cursor:
        return table in schema_editor.connection.introspection.table_names(cursor)


def _columns(schema_editor: Any, table: str) -> set[str]:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        return {column.name for column in connection.introspection.get_table_description(cursor, table)}


def _constraints(schema_editor: Any, table: str) -> set[str]:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, table))


class CreateModel(migrations.CreateModel):
    """``CreateModel`` that keeps a table of the same name made by the plain store (and its rows)."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = to_state.apps.get_model(app_label, self.name)
        table = model._meta.db_table
        if self.allow_migrate_model(schema_editor.connection.alias, model) and _table_exists(schema_editor, table):
            logger.info("table %s already exists (made by the plain store): adopted with its rows", table)
            return
        super().database_forwards(app_label, schema_editor, from_state, to_state)


class AddField(migrations.AddField):
    """``AddField`` that keeps a column the plain store already added."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        column = model._meta.get_field(self.name).column
        if self.allow_migrate_model(schema_editor.connection.alias, model) and column in _columns(
            schema_editor, model._meta.db_table
        ):
            return
        super().database_forwards(app_label, schema_editor, from_state, to_state)


class AddIndex(migrations.AddIndex):
    """``AddIndex`` that keeps an index of the same name the plain store already made."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and self.index.name in _constraints(
            schema_editor, model._meta.db_table
        ):
            return
        super().database_forwards(app_label, schema_editor, from_state, to_state)
