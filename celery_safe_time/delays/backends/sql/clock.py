"""The database's clock for the SQL store: every "when" of the store is measured on it."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ....clock import as_utc
from ....config import mask_url
from ....exceptions import StoreError
from ..base import NOW_SQL


def now_sql(dialect: str) -> sa.TextClause:
    query = NOW_SQL.get(dialect)
    if query is None:  # pragma: no cover - guarded by the settings check
        raise StoreError(f"unsupported store dialect {dialect!r}")
    return sa.text(query)


def database_now(engine: Engine) -> datetime:
    """The database server's clock, as an aware UTC datetime."""
    query = now_sql(engine.dialect.name)
    try:
        with engine.connect() as conn:
            value = conn.execute(query).scalar_one()
    except sa.exc.SQLAlchemyError as exc:
        raise StoreError(f"store {mask_url(str(engine.url))} unreachable: {exc.__class__.__name__}: {exc}") from exc
    return as_utc(value)
