"""The coordination backend of an app: Redis (the default) or PostgreSQL (``safe_time_coordination_url``).

Everything beat and the locks share between processes (the lease and its epoch, fired slots, schedule
state, overlap locks and fencing numbers, idempotency markers, unique keys) lives in one of them. On
PostgreSQL each process keeps one SQLAlchemy engine (a pool of ``COORDINATION_POOL_SIZE`` connections,
``COORDINATION_POOL_OVERFLOW`` more under load), made on first use and made again after a fork: a
connection must never be shared by a parent and its child (Celery's prefork pool forks workers).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

import sqlalchemy as sa

from . import constants as C
from .config import SafeTimeConfig
from .exceptions import ImproperlyConfigured
from .sql.engine import create_engine, normalize_url

logger = logging.getLogger(__name__)

_ENGINES: dict[tuple[int, str, bool, float, float | None], sa.Engine] = {}
_ENGINES_LOCK = threading.Lock()


def uses_postgres(config: SafeTimeConfig) -> bool:
    """True when this app coordinates through PostgreSQL (and needs no Redis)."""
    return config.coordination == C.COORDINATION_POSTGRES


def postgres_url(config: SafeTimeConfig) -> str:
    """The coordination database's URL; a Django store's is built from ``DATABASES["default"]``."""
    if config.coordination_url != C.DJANGO_STORE:
        return config.coordination_url
    from django.db import connection

    if connection.vendor != "postgresql":
        raise ImproperlyConfigured(
            "safe_time_coordination_url",
            f"'store' needs a PostgreSQL store; Django's default database is {connection.vendor}",
        )
    params = connection.get_connection_params()
    return str(
        sa.URL.create(
            "postgresql+psycopg",
            username=params.get("user"),
            password=params.get("password"),
            host=params.get("host") or None,
            port=int(params["port"]) if params.get("port") else None,
            database=params.get("dbname"),
        )
    )


def deadline_args(config: SafeTimeConfig) -> dict[str, Any]:
    """libpq connection parameters that bound how long a coordination connection can hang.

    A database (or a proxy in front of it) that stops answering would otherwise hold a call, and the
    thread making it, until the kernel gives the connection up (minutes to hours). ``connect_timeout``
    bounds connecting; TCP keepalives end an idle connection whose peer is gone; ``tcp_user_timeout``
    one whose data stays unacknowledged; ``statement_timeout`` (when set) a statement the server
    itself keeps waiting. A peer that acknowledges but never answers (a stuck proxy) is left to the
    client's own wait: the lock statements' poll, and for every other statement the engine's answer
    deadline (:func:`~celery_safe_time.sql.engine.answer_deadline_connection`).
    """
    timeout = config.coordination_io_timeout
    args: dict[str, Any] = {
        "connect_timeout": C.DB_CONNECT_TIMEOUT,
        "keepalives": 1,
        "keepalives_idle": max(1, int(timeout / 2)),
        "keepalives_interval": max(1, int(timeout / (2 * C.COORDINATION_KEEPALIVE_COUNT))),
        "keepalives_count": C.COORDINATION_KEEPALIVE_COUNT,
        "tcp_user_timeout": max(1, int(timeout * 1000)),
    }
    if config.coordination_statement_timeout is not None:
        args["options"] = f"-c statement_timeout={max(1, int(config.coordination_statement_timeout * 1000))}"
    return args


def coordination_engine(config: SafeTimeConfig, *, autocommit: bool = False) -> sa.Engine:
    """This process's engine for the coordination database (one per URL, new after a fork).

    ``autocommit``: a second engine whose connections run each statement as its own transaction, with
    no pre-ping (the locks: one statement, one round trip; they repeat a call whose pooled
    connection broke, :meth:`~celery_safe_time.locks.backends.postgres.PostgresLockBackend._run`).
    """
    url = postgres_url(config)
    key = (os.getpid(), url, autocommit, config.coordination_io_timeout, config.coordination_statement_timeout)
    engine = _ENGINES.get(key)
    if engine is not None:
        return engine
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            options: dict[str, Any] = {}
            if normalize_url(url).startswith("postgresql"):
                options["connect_args"] = deadline_args(config)
            if normalize_url(url).startswith("postgresql+psycopg:"):
                # No server-side prepared statements (psycopg 3 prepares a query run 5 times on a
                # connection): they are session state, which PgBouncer in transaction mode (before 1.21)
                # does not keep. Coordination statements are small; planning them each time costs little.
                options["connect_args"]["prepare_threshold"] = None
            if autocommit:
                options.update(isolation_level="AUTOCOMMIT", pool_pre_ping=False, pool_reset_on_return=None)
            engine = create_engine(
                url,
                pool_size=C.COORDINATION_POOL_SIZE,
                max_overflow=C.COORDINATION_POOL_OVERFLOW,
                answer_deadline=config.coordination_io_timeout,
                **options,
            )
            # Pooled connections left open at exit are dropped unannounced (the server logs a reset per
            # connection; psycopg warns of each): close them as the process exits (registered once).
            atexit.unregister(dispose_engines)
            atexit.register(dispose_engines)
            _ENGINES[key] = engine
            logger.debug("coordination engine for pid %d", os.getpid())
    return engine


def dispose_engines() -> None:
    """Close every pooled coordination connection of this process (tests; at exit, on its own)."""
    with _ENGINES_LOCK:
        for (pid, *_), engine in list(_ENGINES.items()):
            if pid == os.getpid():
                engine.dispose()
        _ENGINES.clear()
