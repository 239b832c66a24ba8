"""Engines for the SQL store and the coordination database: the drivers this package installs, per-call deadlines."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .. import constants as C
from ..config import mask_url, missing_driver_message
from ..exceptions import StoreError

logger = logging.getLogger(__name__)

#: InnoDB's default REPEATABLE READ gap-locks the claim's range scan, so concurrent SKIP LOCKED
#: sweeps would wait on each other; READ COMMITTED locks only the rows picked, as on PostgreSQL.
MYSQL_ISOLATION_LEVEL = "READ COMMITTED"
#: TCP keepalive probes before a silent PostgreSQL/MySQL peer counts as gone; the first probe and the
#: gap between probes are shares of ``safe_time_store_timeout`` so the whole count fits within it.
STORE_KEEPALIVE_COUNT = 3

#: How much longer than the server's ``statement_timeout`` the client waits for an answer: a server
#: that is reachable cancels the statement itself first and says why.
ANSWER_DEADLINE_MARGIN = 2.0

#: URL prefixes without a driver -> the driver this package installs (extras ``postgres``, ``mysql``).
_DEFAULT_DRIVERS = {
    "postgres://": "postgresql+psycopg://",
    "postgresql://": "postgresql+psycopg://",
    "mysql://": "mysql+pymysql://",
    "mariadb://": "mariadb+pymysql://",
}


def normalize_url(url: str) -> str:
    """Pick the drivers this package installs: psycopg 3 for PostgreSQL, PyMySQL for MySQL/MariaDB."""
    for prefix, replacement in _DEFAULT_DRIVERS.items():
        if url.startswith(prefix):
            return replacement + url[len(prefix) :]
    return url


def deadline_args(url: str, timeout: float) -> dict[str, Any]:
    """The driver's connect arguments that give every call on a connection of ``url`` a deadline of
    ``timeout`` seconds (``safe_time_store_timeout``), so that a hung network path or a stuck server
    ends in an error instead of a call that never returns.

    PostgreSQL (libpq): ``statement_timeout`` (the server cancels a statement that runs or waits
    longer), ``tcp_user_timeout`` (data sent and not acknowledged for that long: the connection is
    dropped) and keepalive probes (a silent peer on an idle connection counts as gone within it).
    MySQL/MariaDB (PyMySQL): read and write timeouts on the socket. SQLite: none (a local file).
    """
    millis = max(1, int(timeout * 1000))
    if url.startswith("postgresql"):
        probe = max(1, int(timeout / (STORE_KEEPALIVE_COUNT + 1)))
        return {
            "keepalives": 1,
            "keepalives_idle": probe,
            "keepalives_interval": probe,
            "keepalives_count": STORE_KEEPALIVE_COUNT,
            "tcp_user_timeout": millis,
            "options": f"-c statement_timeout={millis}",
        }
    if url.startswith(("mysql", "mariadb")):
        seconds = max(1, math.ceil(timeout))
        return {"read_timeout": seconds, "write_timeout": seconds}
    return {}


def create_engine(
    url: str, *, timeout: float | None = None, answer_deadline: float | None = None, **kwargs: Any
) -> Engine:
    """An engine for ``url``; ``timeout``: :func:`deadline_args` on every connection (None: none).

    ``answer_deadline`` (PostgreSQL with psycopg 3.3+; ``timeout`` plus :data:`ANSWER_DEADLINE_MARGIN`
    when only ``timeout`` is given): the longest any call waits for the server's answer, on the
    client's side (:func:`answer_deadline_connection`). ``connect_args`` given here are added to the
    package's (libpq ``options`` are joined)."""
    url = normalize_url(url)
    options: dict[str, Any] = {"pool_pre_ping": True, "future": True}
    connect: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # One writer at a time; wait for it instead of failing at once.
        connect = {"timeout": 30}
    elif url.startswith("postgresql"):
        connect = {"connect_timeout": C.DB_CONNECT_TIMEOUT}
    elif url.startswith(("mysql", "mariadb")):
        connect = {"connect_timeout": C.DB_CONNECT_TIMEOUT}
        options["isolation_level"] = MYSQL_ISOLATION_LEVEL
    for extra in (deadline_args(url, timeout) if timeout else {}, kwargs.pop("connect_args", None) or {}):
        for name, value in extra.items():
            joined = name == "options" and connect.get("options")
            connect[name] = f"{connect['options']} {value}" if joined else value
    options["connect_args"] = connect
    options.update(kwargs)
    try:
        engine = sa.create_engine(url, **options)
    except ImportError as exc:
        raise StoreError(missing_driver_message(url, exc)) from exc
    except sa.exc.ArgumentError as exc:
        raise StoreError(f"cannot create a store engine for {mask_url(url)}: {exc}") from exc
    if answer_deadline is None and timeout:
        answer_deadline = timeout + ANSWER_DEADLINE_MARGIN
    if answer_deadline and url.startswith("postgresql+psycopg:"):
        connection_class = answer_deadline_connection(float(answer_deadline))
        if connection_class is not None:

            def connect_with_deadline(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
                return connection_class.connect(*cargs, **cparams)

            sa.event.listen(engine, "do_connect", connect_with_deadline)
    return engine


@functools.cache
def answer_deadline_connection(seconds: float) -> Any:
    """A psycopg connection class whose every wait for the server ends after ``seconds``.

    The server's ``statement_timeout`` and the kernel's keepalives and ``tcp_user_timeout`` cannot end
    a wait on a peer that acknowledges every byte and never answers (a hung PgBouncer or proxy, a
    stalled network path behind one): only the client can. Every exchange of a psycopg connection
    (a statement, a commit, a rollback, the pool's ping) waits in ``Connection.wait``; past the
    deadline the connection is closed, mid-exchange it is unusable, and the call raises
    ``OperationalError``, which SQLAlchemy takes as a disconnect (the pool drops the connection).
    None on psycopg older than 3.3, whose wait takes no timeout: the server-side deadlines only.
    """
    import psycopg

    parameters = inspect.signature(psycopg.Connection.wait).parameters
    if "timeout" not in parameters:
        return None
    default_interval = parameters["interval"].default

    class AnswerDeadlineConnection(psycopg.Connection[Any]):
        def wait(self, gen: Any, interval: Any = default_interval, timeout: float | None = None) -> Any:
            limit = seconds if timeout is None else min(timeout, seconds)
            try:
                return super().wait(gen, interval, limit)
            except psycopg.OperationalError as exc:
                if self.closed or type(exc).__name__ != "_WaitTimeout":
                    raise
                self.close()
                logger.warning("no answer from PostgreSQL within %g s; connection closed", seconds)
                raise psycopg.OperationalError(
                    f"no answer from PostgreSQL within {seconds:g} s (the client's deadline); connection closed"
                ) from None

    return AnswerDeadlineConnection


def load_driver(url: str) -> Any:
    """Import the DBAPI module ``url`` uses (psycopg, PyMySQL, sqlite3) without connecting."""
    return sa.engine.make_url(normalize_url(url)).get_dialect().import_dbapi()
