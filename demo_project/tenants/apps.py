from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _sqlite_wal(sender: Any, connection: Any, **kwargs: Any) -> None:
    """The demo's SQLite in write-ahead-log mode: its ten worker and beat processes write one file, and
    in SQLite's default rollback-journal mode every commit waits for a disk flush while every reader
    blocks the writers (on a busy disk a commit took 30-170 ms, which the delays' lateness showed).
    A production store is PostgreSQL or MySQL; this keeps the demo's own database out of the story."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")


class TenantsConfig(AppConfig):
    name = "demo_project.tenants"
    label = "demo_tenants"

    def ready(self) -> None:
        connection_created.connect(_sqlite_wal, dispatch_uid="demo-sqlite-wal")
