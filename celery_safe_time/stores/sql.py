"""SQLAlchemy Core store for PostgreSQL, SQLite and MySQL/MariaDB."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..exceptions import StoreError
from ..redis_client import mask_url
from .base import DelayStore

logger = logging.getLogger(__name__)

UTC = timezone.utc


def normalize_url(url: str) -> str:
    """Pick the drivers this package installs: psycopg 3 for PostgreSQL."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def create_engine(url: str, **kwargs: Any) -> Engine:
    url = normalize_url(url)
    options: dict[str, Any] = {"pool_pre_ping": True, "future": True}
    if url.startswith("sqlite"):
        # One writer at a time; wait for it instead of failing at once.
        options["connect_args"] = {"timeout": 30}
    elif url.startswith("postgresql") or url.startswith(("mysql", "mariadb")):
        options["connect_args"] = {"connect_timeout": 5}
    options.update(kwargs)
    try:
        return sa.create_engine(url, **options)
    except (ImportError, sa.exc.ArgumentError) as exc:
        raise StoreError(f"cannot create a store engine for {mask_url(url)}: {exc}") from exc


def database_now(engine: Engine) -> datetime:
    """The database server's clock, as an aware UTC datetime."""
    dialect = engine.dialect.name
    if dialect == "postgresql":
        query = "SELECT clock_timestamp()"
    elif dialect == "sqlite":
        query = "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"
    elif dialect in ("mysql", "mariadb"):
        query = "SELECT UTC_TIMESTAMP(6)"
    else:  # pragma: no cover - guarded by the settings check
        raise StoreError(f"unsupported store dialect {dialect!r}")
    try:
        with engine.connect() as conn:
            value = conn.execute(sa.text(query)).scalar_one()
    except sa.exc.SQLAlchemyError as exc:
        raise StoreError(f"store {mask_url(str(engine.url))} unreachable: {exc.__class__.__name__}: {exc}") from exc
    return _as_utc(value)


def _as_utc(value: Any) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):  # pragma: no cover - defensive
        raise StoreError(f"database returned {value!r} for now()")
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


class SQLAlchemyStore(DelayStore):
    """Delayed tasks in a SQL table, claimed with ``FOR UPDATE SKIP LOCKED`` where the database has it."""

    def __init__(self, url: str, *, engine: Engine | None = None) -> None:
        self.url = url
        self.engine = engine if engine is not None else create_engine(url)

    def now(self) -> datetime:
        return database_now(self.engine)

    def ping(self) -> None:
        self.now()

    def close(self) -> None:
        self.engine.dispose()
