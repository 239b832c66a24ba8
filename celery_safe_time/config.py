"""The ``safe_time_*`` settings, parsed once per app into a frozen, typed object.

Celery maps Django's ``CELERY_SAFE_TIME_*`` names onto the lowercase keys when the app
was configured with ``namespace="CELERY"``, so reading ``app.conf.get(key)`` covers both.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import numbers
import re
import weakref
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

from . import constants as C
from .clock import as_utc
from .exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

#: The sweep claims a row at most this share of the consumer timeout before it is due, so the worker
#: holding its ``eta`` message unacked stays far from the timeout (the 2 s look-ahead is the usual cap).
SWEEP_LOOKAHEAD_CONSUMER_SHARE = 0.1
#: Likewise on brokers that redeliver after ``visibility_timeout``: at most this share of it.
SWEEP_LOOKAHEAD_VISIBILITY_SHARE = 0.1

_CACHE: weakref.WeakKeyDictionary[Celery, SafeTimeConfig] = weakref.WeakKeyDictionary()


def _hide_url_settings_in_celery_reports() -> None:
    """``celery report`` and ``app.conf.humanize(censored=True)`` mask the settings whose names match
    Celery's ``HIDDEN_SETTINGS``; our ``safe_time_*_url`` settings may carry passwords too."""
    from celery.app import utils

    pattern = utils.HIDDEN_SETTINGS
    if "SAFE_TIME_" not in pattern.pattern:
        utils.HIDDEN_SETTINGS = re.compile(pattern.pattern + r"|SAFE_TIME_\w*URL", pattern.flags | re.IGNORECASE)


_hide_url_settings_in_celery_reports()


@dataclasses.dataclass(frozen=True)
class SafeTimeConfig:
    """All celery-safe-time settings of one app. Build it with :func:`get_config`."""

    redis_url: str
    key_prefix: str = C.DEFAULT_KEY_PREFIX
    beat_lease: float = C.DEFAULT_BEAT_LEASE
    misfire: str = C.DEFAULT_MISFIRE
    misfire_grace: float | None = C.DEFAULT_MISFIRE_GRACE
    delay_threshold: float = C.DEFAULT_DELAY_THRESHOLD_CAP
    store_url: str = C.DEFAULT_STORE_URL
    #: The rows of the store this app claims, lists, counts, cancels and purges (its own and legacy ones).
    store_namespace: str = C.DEFAULT_STORE_NAMESPACE
    sweep_interval: float = C.DEFAULT_SWEEP_INTERVAL
    sweep_batch: int = C.DEFAULT_SWEEP_BATCH
    sweep_queue: str | None = C.DEFAULT_SWEEP_QUEUE
    allow_pickle: bool = C.DEFAULT_ALLOW_PICKLE
    claim_timeout: float = C.DEFAULT_CLAIM_TIMEOUT
    lock_ttl: float = C.DEFAULT_LOCK_TTL
    store_timeout: float = C.DEFAULT_STORE_TIMEOUT
    max_clock_skew: float = C.DEFAULT_MAX_CLOCK_SKEW
    #: Seconds a sent/cancelled/expired row is kept before the sweep deletes it; None keeps them forever.
    delay_retention: float | None = C.DEFAULT_DELAY_RETENTION
    #: Seconds after its due time (or its last publish) a sent but never started row is published again.
    delivery_grace: float = C.DEFAULT_DELIVERY_GRACE
    #: The broker's visibility timeout, or None when the broker has none (AMQP).
    visibility_timeout: float | None = None
    #: ``amqp`` (RabbitMQ), ``redis``, ``sqs`` or ``other`` (memory://, filesystem://, ...), from broker_url.
    broker_kind: str = C.BROKER_OTHER
    #: RabbitMQ's ``consumer_timeout`` in seconds (``safe_time_broker_consumer_timeout``; 1800 on amqp),
    #: or None: no broker countdown (threshold, look-ahead, re-queues) may come near it.
    broker_consumer_timeout: float | None = None
    #: Why the threshold has its value, for ``safe-time check`` ("default: min(...)" or "set explicitly").
    delay_threshold_reason: str = ""
    #: ``safe_time_redis_url`` is a ``redis+cluster://`` / ``rediss+cluster://`` URL: keys get hash tags.
    redis_cluster: bool = False
    #: The adaptive look-ahead never reaches past this many pending rows (workers hold early rows in memory).
    sweep_max_ahead: int = C.DEFAULT_SWEEP_MAX_AHEAD
    #: ``redis`` (the default: ``safe_time_redis_url``) or ``postgres``; see :attr:`coordination_url`.
    coordination: str = C.COORDINATION_REDIS
    #: The PostgreSQL URL of the coordination backend ("" on Redis). ``safe_time_coordination_url =
    #: "store"`` gives the store's URL here, or ``"django"`` for a Django store (resolved from
    #: ``DATABASES`` when first connected, :func:`celery_safe_time.coordination.postgres_url`).
    coordination_url: str = ""
    #: How overlap locks are held on PostgreSQL (``safe_time_coordination_locks``): ``lease`` rows
    #: (the default) or ``session`` advisory locks; ignored on Redis.
    coordination_locks: str = C.PG_LOCK_MODE_LEASE
    #: ``safe_time_coordination_io_timeout``: seconds one coordination database call waits for its answer.
    coordination_io_timeout: float = C.DEFAULT_COORDINATION_IO_TIMEOUT
    #: ``safe_time_coordination_statement_timeout``: the server's ``statement_timeout`` for coordination
    #: connections, in seconds (None: the server's own setting; sent as a startup option).
    coordination_statement_timeout: float | None = None
    #: ``safe_time_beat_history_size``: runs kept per beat entry (0: no run history).
    beat_history_size: int = C.DEFAULT_BEAT_HISTORY_SIZE
    #: ``safe_time_beat_audit_size``: changes kept per beat entry (0: no change audit).
    beat_audit_size: int = C.DEFAULT_BEAT_AUDIT_SIZE

    def key(self, template: str, **parts: Any) -> str:
        """Return a prefixed Redis key from a template of :mod:`celery_safe_time.constants`.

        On a Redis Cluster the name carries a hash tag (:func:`cluster_key_name`); elsewhere it is
        the template as it always was, so an upgrade never renames a key under a running beat.
        """
        if self.redis_cluster:
            return self.key_prefix + cluster_key_name(template, parts)
        return self.key_prefix + template.format(**parts)

    def key_maker(self, template: str) -> Callable[..., str]:
        """``functools.partial(self.key, template)``, as one C-level call where no hash tag is needed:
        the lock backend names four keys per locked task."""
        if self.redis_cluster:
            return functools.partial(self.key, template)
        return (self.key_prefix.replace("{", "{{").replace("}", "}}") + template).format

    @property
    def beat_renew_interval(self) -> float:
        return self.beat_lease / 3.0

    @property
    def sweep_lookahead(self) -> float:
        """Seconds before its due time a row may be claimed and published with ``eta=due_at``.

        A worker holds that message unacked until the eta, so under a consumer timeout the look-ahead
        is a small share of it (a test broker with an 8 s timeout must not lose workers to it).
        """
        if self.broker_consumer_timeout is None:
            return C.SWEEP_LOOKAHEAD
        return min(C.SWEEP_LOOKAHEAD, self.broker_consumer_timeout * SWEEP_LOOKAHEAD_CONSUMER_SHARE)

    @property
    def sweep_lookahead_max(self) -> float:
        """The most the adaptive look-ahead may grow to under a backlog: the broker's safe window.

        A worker holds an early row's ``eta`` message unacked until it is due, so it stays a tenth of
        the visibility timeout (Redis, SQS: redelivered after it) and of the consumer timeout
        (RabbitMQ: the channel is closed after it), and at most ``SWEEP_LOOKAHEAD_MAX``.
        """
        ceiling = C.SWEEP_LOOKAHEAD_MAX
        if self.visibility_timeout is not None:
            ceiling = min(ceiling, self.visibility_timeout * SWEEP_LOOKAHEAD_VISIBILITY_SHARE)
        if self.broker_consumer_timeout is not None:
            ceiling = min(ceiling, self.broker_consumer_timeout * SWEEP_LOOKAHEAD_CONSUMER_SHARE)
        return max(ceiling, self.sweep_lookahead)


def cluster_key_name(template: str, parts: dict[str, Any]) -> str:
    """``template`` rendered with the hash tag a Redis Cluster needs (the prefix not included).

    Beat keys share one tag (``{beat}:lease``, ``{beat}:fired:<entry>:<slot>``): the dispatch script
    touches the lease, the epoch, a fired marker, the state and the due set at once. A template with
    a ``key`` part gets that part braced (``lock:{<key>}``, ``lock-fence:{<key>}``,
    ``lock-done:{<key>}:<identity>``), so a lock, its fence and its markers share the key's slot; the
    idempotency namespace stays outside the braces (``lock:idem:{<key>}`` and ``idem:{<key>}``), as
    one script takes the in-progress lock of an idempotent key and checks its marker. Redis hashes
    the text between the first ``{`` and the next ``}``: the text before our ``{`` is fixed and has
    no brace (the prefix is checked), so a key that itself holds braces still hashes the same in
    every name of its set. A key that is empty or starts with ``}`` would make an empty tag (Redis then
    hashes the whole name): it gets a ``~`` in front, as does a key starting with ``~`` so that no two
    keys share a name. Other templates are single-key and get no tag.
    """
    if template.startswith(C.KEY_BEAT_NAMESPACE):
        return C.CLUSTER_BEAT_TAG + ":" + template[len(C.KEY_BEAT_NAMESPACE) :].format(**parts)
    if "key" in parts:
        value = str(parts["key"])
        # The marker ``idem:<key>`` is tagged by the bare key its lock ``lock:idem:<key>`` is tagged by.
        in_namespace = template != C.KEY_IDEMPOTENT and value.startswith(C.IDEMPOTENT_LOCK_NAMESPACE)
        namespace = C.IDEMPOTENT_LOCK_NAMESPACE if in_namespace else ""
        tag = value[len(namespace) :]
        if not tag or tag[0] in C.CLUSTER_TAG_ESCAPED:
            tag = C.CLUSTER_TAG_ESCAPE + tag
        parts = {**parts, "key": namespace + "{" + tag + "}"}
    return template.format(**parts)


#: Query parameters whose value is a secret: redis-py and libpq read passwords from the query string
#: (``?password=``, ``?sentinel_password=``, ``?sslpassword=``) as well as from ``user:pass@``.
_SECRET_QUERY_NAME = re.compile(r"pass|pwd|secret|token|credential|auth", re.IGNORECASE)


def mask_url(url: str | None) -> str:
    """Return ``url`` with any password replaced by ``***`` (safe for logs and banners).

    Both places a URL carries a password are masked: ``user:pass@`` and query parameters named like
    a secret (``?password=...``).
    """
    if not url:
        return ""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = _mask_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _mask_query(query: str) -> str:
    """``query`` with the value of every secret-named parameter replaced by ``***`` (order kept)."""
    if not query:
        return query
    pairs = []
    for pair in query.split("&"):
        name, sep, value = pair.partition("=")
        pairs.append(f"{name}=***" if sep and value and _SECRET_QUERY_NAME.search(name) else pair)
    return "&".join(pairs)


#: Database URL schemes -> the extra that installs the driver the package uses, that driver, a URL.
_DRIVER_EXTRAS = {
    "postgresql": ("postgres", "psycopg", "postgresql://user:password@host:5432/dbname"),
    "postgres": ("postgres", "psycopg", "postgresql://user:password@host:5432/dbname"),
    "mysql": ("mysql", "pymysql", "mysql://user:password@host:3306/dbname"),
    "mariadb": ("mysql", "pymysql", "mariadb://user:password@host:3306/dbname"),
}


def missing_driver_message(url: str, exc: BaseException) -> str:
    """What to install (the extra) and which URL form to use when ``url``'s database driver is missing:
    a bare ``No module named 'psycopg2'`` says neither."""
    scheme = url.partition(":")[0].lower()
    base, _, driver = scheme.partition("+")
    known = _DRIVER_EXTRAS.get(base)
    where = f"the database driver for {mask_url(url)} is not installed ({exc})"
    if known is None:
        return where
    extra, package_driver, form = known
    message = f"{where}: pip install 'celery-safe-time[{extra}]'"
    if driver and driver != package_driver:
        return f"{message}, which brings {package_driver}: write the URL without '+{driver}', as {form}"
    return f"{message} (URL form: {form})"


def get_config(app: Celery) -> SafeTimeConfig:
    """Return the app's parsed settings, parsing and validating them on first use."""
    try:
        return _CACHE[app]
    except KeyError:
        pass
    try:
        config = parse_config(
            app.conf.get, broker_url=first_broker_url(app), transport_options=_transport_options(app), app_name=app.main
        )
    except ImproperlyConfigured as exc:
        hint = near_miss_hint(app, exc)
        if hint is None:
            raise
        raise ImproperlyConfigured(exc.key, f"{str(exc).removeprefix(exc.key + ': ')}; {hint}") from None
    _CACHE[app] = config
    if _LOG_SETTING_WARNINGS:
        for message in setting_warnings(app):
            logger.warning("%s", message)
    return config


#: Whether :func:`get_config` logs :func:`setting_warnings`; ``safe-time check`` shows them as rows instead.
_LOG_SETTING_WARNINGS = True


def log_setting_warnings(enabled: bool) -> None:
    """Have :func:`get_config` log the settings warnings (the default) or not (a command that reports
    them itself, ``safe-time check``, so they are not said twice)."""
    global _LOG_SETTING_WARNINGS
    _LOG_SETTING_WARNINGS = enabled


def setting_warnings(app: Celery) -> list[str]:
    """Every warning about how ``app`` is configured: misspelt ``safe_time_*`` keys, ``SAFE_TIME_*``
    keys outside the app's namespace (never read), and a Django project's store falling back to a
    SQLite file in the current directory."""
    messages = unknown_settings(app) + _outside_namespace(app)
    if app.conf.get("safe_time_store_url") is None and _reads_django_settings(app):
        prefix = _namespace_prefix(app)
        messages.append(
            f"{prefix}SAFE_TIME_STORE_URL is not set: stored delays go to {C.DEFAULT_STORE_URL}, a file in the "
            f"current directory; set {prefix}SAFE_TIME_STORE_URL = 'django' to keep them in the project's database"
        )
    return messages


@functools.cache
def known_setting_names() -> frozenset[str]:
    """Every ``safe_time_*`` key there is: the ones :func:`parse_config` reads (so a setting added
    there is known here too), and the Django admin's app setting."""
    read: set[str] = set()

    def get(key: str) -> Any:
        read.add(key)
        return None

    # Every key is read whatever the values; a Redis broker makes the defaults valid.
    parse_config(get, broker_url="redis://localhost")
    return frozenset(read | {C.DJANGO_APP_SETTING.lower()})


def unknown_settings(app: Celery) -> list[str]:
    """One message per ``safe_time_*`` key ``app`` sets that does not exist (it is ignored), with the
    closest known key."""
    return unknown_setting_warnings(_setting_names(app), known_setting_names())


def near_miss_hint(app: Celery, error: ImproperlyConfigured) -> str | None:
    """For an error about a setting: the ignored keys ``app`` sets whose closest known key is the
    one the error names or mentions (``safe_time_coordination_ulr`` under "set
    safe_time_coordination_url ..."), or None."""
    known = known_setting_names()
    text = str(error)
    hints = []
    for name in sorted(set(_setting_names(app))):
        close = _closest_setting(name, known)
        if name.startswith(C.SETTING_PREFIX) and name not in known and close is not None and close in text:
            hints.append(f"the app sets {name!r}, which is ignored: did you mean {close!r}?")
    return "; ".join(hints) or None


def _namespace_prefix(app: Celery) -> str:
    """What the app's setting names start with: ``"CELERY_"`` for ``namespace="CELERY"``, else ``""``."""
    return str(app.conf.prefix or "")


def _reads_django_settings(app: Celery) -> bool:
    """Whether ``app`` is configured from Django's settings (``config_from_object("django.conf:settings")``)."""
    source = getattr(app, "_config_source", None)
    if isinstance(source, str):
        return source.partition(":")[0] == "django.conf"
    return type(source).__module__ == "django.conf"


def _unread(key: str, prefix: str) -> bool:
    """A ``SAFE_TIME_*`` key set outside the app's namespace, in capitals (Django's settings): Celery
    reads ``<prefix>SAFE_TIME_*`` and the lowercase key, never this one."""
    return (
        key.lower().startswith(C.SETTING_PREFIX)
        and key != key.lower()
        and not (prefix and key.upper().startswith(prefix.upper()))
        and key != C.DJANGO_APP_SETTING
    )


def _outside_namespace(app: Celery) -> list[str]:
    """One message per ``SAFE_TIME_*`` key ``app``'s configuration holds that is never read, naming
    the key and the name it needs (``SAFE_TIME_STORE_URL`` under ``namespace="CELERY"``)."""
    prefix = _namespace_prefix(app)
    messages = []
    for key in sorted({k for k in app.conf.without_defaults() if isinstance(k, str) and _unread(k, prefix)}):
        wanted = f"{prefix.upper()}{key.upper()}" if prefix else key.lower()
        where = f"the app reads its settings with the {prefix!r} prefix" if prefix else "the app reads lowercase keys"
        messages.append(f"setting {key!r} is ignored: {where}; name it {wanted!r}")
    return messages


def _setting_names(app: Celery) -> list[str]:
    """The keys set on ``app.conf`` (not Celery's defaults) that Celery reads, lowercased and without
    the Django namespace prefix (``CELERY_SAFE_TIME_BEAT_LEASE`` -> ``safe_time_beat_lease``)."""
    namespace = (app.conf.prefix or "").lower()
    prefix = _namespace_prefix(app)
    names = []
    for key in app.conf.without_defaults():
        if not isinstance(key, str) or _unread(key, prefix):
            continue
        name = key.lower()
        if namespace and name.startswith(namespace):
            name = name[len(namespace) :]
        names.append(name)
    return names


def unknown_setting_warnings(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """One message per ``safe_time_*`` name in ``names`` that is not in ``known``, with the closest
    known key: a misspelt setting is otherwise ignored, and its default silently used."""
    known_keys = sorted(set(known))
    messages = []
    for name in sorted(set(names)):
        if not name.startswith(C.SETTING_PREFIX) or name in known_keys:
            continue
        close = _closest_setting(name, known_keys)
        hint = f"did you mean {close!r}?" if close else f"known settings: {', '.join(known_keys)}"
        messages.append(f"unknown setting {name!r} is ignored: {hint}")
    return messages


def _closest_setting(name: str, known: Iterable[str]) -> str | None:
    # Compared without the shared prefix, which would make every name look close to every key.
    tail = len(C.SETTING_PREFIX)
    close = difflib.get_close_matches(name[tail:], [key[tail:] for key in known], n=1, cutoff=0.6)
    return C.SETTING_PREFIX + close[0] if close else None


def reset_config(app: Celery) -> None:
    """Forget the cached settings of ``app`` (tests change ``app.conf`` between cases)."""
    _CACHE.pop(app, None)


def first_broker_url(app: Celery) -> str:
    """The app's broker URL (the first of a failover list), or ""."""
    url = app.conf.broker_url or ""
    # broker_url may be a list/semicolon-separated failover list; the first names the transport.
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    return str(url).split(";")[0].strip()


def _transport_options(app: Celery) -> dict[str, Any]:
    return dict(app.conf.broker_transport_options or {})


def parse_config(
    get: Callable[[str], Any],
    *,
    broker_url: str = "",
    transport_options: dict[str, Any] | None = None,
    app_name: str | None = None,
) -> SafeTimeConfig:
    """Validate raw settings read through ``get(key)`` and build a :class:`SafeTimeConfig`.

    Pure: takes the lookup function so tests can pass a dict's ``get``.
    """
    transport_options = transport_options or {}
    scheme = urlsplit(broker_url).scheme.split("+")[0].lower() if broker_url else ""
    kind = broker_kind(scheme)

    visibility_timeout: float | None = None
    if scheme in C.VISIBILITY_TIMEOUT_SCHEMES:
        sqs = kind == C.BROKER_SQS
        default_vt = C.KOMBU_SQS_DEFAULT_VISIBILITY_TIMEOUT if sqs else C.KOMBU_DEFAULT_VISIBILITY_TIMEOUT
        visibility_timeout = _number(
            "broker_transport_options.visibility_timeout",
            transport_options.get("visibility_timeout", default_vt),
            positive=True,
        )
        if kind == C.BROKER_SQS and visibility_timeout > C.SQS_MAX_VISIBILITY_TIMEOUT:
            raise ImproperlyConfigured(
                "broker_transport_options.visibility_timeout",
                f"{visibility_timeout:g} s is above SQS's maximum visibility timeout "
                f"({C.SQS_MAX_VISIBILITY_TIMEOUT:g} s, 12 h): SQS refuses it",
            )

    consumer_timeout_raw = get("safe_time_broker_consumer_timeout")
    consumer_timeout: float | None
    if consumer_timeout_raw is None:
        consumer_timeout = C.DEFAULT_AMQP_CONSUMER_TIMEOUT if kind == C.BROKER_AMQP else None
    else:
        # Honoured on any broker when set: a failover list or a proxy may hide RabbitMQ behind another URL.
        consumer_timeout = _number("safe_time_broker_consumer_timeout", consumer_timeout_raw, positive=True)

    store_url = _default(get("safe_time_store_url"), C.DEFAULT_STORE_URL)
    store_url = _store_url("safe_time_store_url", store_url)
    coordination, coordination_url = _coordination(get("safe_time_coordination_url"), store_url)
    coordination_locks = _default(get("safe_time_coordination_locks"), C.PG_LOCK_MODE_LEASE)
    if coordination_locks not in C.PG_LOCK_MODES:
        raise ImproperlyConfigured(
            "safe_time_coordination_locks", f"must be one of {', '.join(C.PG_LOCK_MODES)}, got {coordination_locks!r}"
        )

    coordination_io_timeout = _number(
        "safe_time_coordination_io_timeout",
        _default(get("safe_time_coordination_io_timeout"), C.DEFAULT_COORDINATION_IO_TIMEOUT),
    )
    statement_timeout_raw = get("safe_time_coordination_statement_timeout")
    coordination_statement_timeout = (
        None
        if statement_timeout_raw is None
        else _number("safe_time_coordination_statement_timeout", statement_timeout_raw, positive=True)
    )

    redis_url = get("safe_time_redis_url")
    if redis_url is None:
        if scheme in ("redis", "rediss"):
            redis_url = broker_url
        elif coordination == C.COORDINATION_POSTGRES:
            redis_url = ""  # nothing of this package talks to Redis
        else:
            raise ImproperlyConfigured(
                "safe_time_redis_url",
                "is required when broker_url is not a redis:// or rediss:// URL "
                "(or set safe_time_coordination_url to a PostgreSQL database)",
            )
    if redis_url or coordination == C.COORDINATION_REDIS:
        redis_url = _redis_url("safe_time_redis_url", redis_url)

    key_prefix = get("safe_time_key_prefix")
    if key_prefix is None:
        key_prefix = C.DEFAULT_KEY_PREFIX
    if not isinstance(key_prefix, str) or not key_prefix:
        raise ImproperlyConfigured("safe_time_key_prefix", f"must be a non-empty string, got {key_prefix!r}")
    redis_cluster = bool(redis_url) and urlsplit(redis_url).scheme.lower() in C.REDIS_CLUSTER_SCHEMES
    if redis_cluster and ("{" in key_prefix or "}" in key_prefix):
        raise ImproperlyConfigured(
            "safe_time_key_prefix",
            f"{key_prefix!r} holds a brace; on a Redis Cluster celery-safe-time places the hash tags itself "
            "(a prefix tag would put every key in one slot, a lone brace would split a script's keys)",
        )

    misfire = _default(get("safe_time_misfire"), C.DEFAULT_MISFIRE)
    if misfire not in C.MISFIRE_POLICIES:
        raise ImproperlyConfigured(
            "safe_time_misfire",
            f"must be one of {', '.join(sorted(C.MISFIRE_POLICIES))}, got {misfire!r}",
        )

    misfire_grace_raw = get("safe_time_misfire_grace")
    misfire_grace = (
        None if misfire_grace_raw is None else _number("safe_time_misfire_grace", misfire_grace_raw, positive=True)
    )

    delay_threshold, threshold_reason = _delay_threshold(
        get("safe_time_delay_threshold"), kind, visibility_timeout, consumer_timeout
    )

    lock_ttl = _number("safe_time_lock_ttl", _default(get("safe_time_lock_ttl"), C.DEFAULT_LOCK_TTL))
    # A delivery that finds its run alive elsewhere comes back within lock_ttl / 2 as a broker
    # countdown, which a worker holds unacked: it must stay below the consumer timeout too.
    recheck = lock_ttl * C.DELIVERY_RUNNING_RECHECK * 1.5
    if consumer_timeout is not None and recheck >= consumer_timeout:
        raise ImproperlyConfigured(
            "safe_time_lock_ttl",
            f"{lock_ttl:g} s makes re-queued deliveries wait up to {recheck:g} s in a worker, at or above "
            f"safe_time_broker_consumer_timeout ({consumer_timeout:g} s): RabbitMQ would close the worker's channel",
        )

    store_namespace = _store_namespace(get("safe_time_store_namespace"), app_name)

    sweep_queue = get("safe_time_sweep_queue")
    if sweep_queue is not None and (not isinstance(sweep_queue, str) or not sweep_queue):
        raise ImproperlyConfigured("safe_time_sweep_queue", f"must be a queue name or None, got {sweep_queue!r}")

    sweep_batch = _default(get("safe_time_sweep_batch"), C.DEFAULT_SWEEP_BATCH)
    if isinstance(sweep_batch, bool) or not isinstance(sweep_batch, int) or sweep_batch <= 0:
        raise ImproperlyConfigured("safe_time_sweep_batch", f"must be a positive integer, got {sweep_batch!r}")

    sweep_max_ahead = _default(get("safe_time_sweep_max_ahead"), C.DEFAULT_SWEEP_MAX_AHEAD)
    if isinstance(sweep_max_ahead, bool) or not isinstance(sweep_max_ahead, int) or sweep_max_ahead <= 0:
        raise ImproperlyConfigured("safe_time_sweep_max_ahead", f"must be a positive integer, got {sweep_max_ahead!r}")

    beat_history_size = _count(
        "safe_time_beat_history_size", get("safe_time_beat_history_size"), C.DEFAULT_BEAT_HISTORY_SIZE
    )
    beat_audit_size = _count("safe_time_beat_audit_size", get("safe_time_beat_audit_size"), C.DEFAULT_BEAT_AUDIT_SIZE)

    allow_pickle = _default(get("safe_time_allow_pickle"), C.DEFAULT_ALLOW_PICKLE)
    if not isinstance(allow_pickle, bool):
        raise ImproperlyConfigured("safe_time_allow_pickle", f"must be True or False, got {allow_pickle!r}")

    max_clock_skew = _number(
        "safe_time_max_clock_skew", _default(get("safe_time_max_clock_skew"), C.DEFAULT_MAX_CLOCK_SKEW), positive=False
    )

    retention_raw = _default(get("safe_time_delay_retention"), C.DEFAULT_DELAY_RETENTION)
    delay_retention = (
        None if retention_raw is None else _number("safe_time_delay_retention", retention_raw, positive=True)
    )

    return SafeTimeConfig(
        redis_url=redis_url,
        key_prefix=key_prefix,
        beat_lease=_number("safe_time_beat_lease", _default(get("safe_time_beat_lease"), C.DEFAULT_BEAT_LEASE)),
        misfire=misfire,
        misfire_grace=misfire_grace,
        delay_threshold=delay_threshold,
        store_url=store_url,
        store_namespace=store_namespace,
        sweep_interval=_number(
            "safe_time_sweep_interval", _default(get("safe_time_sweep_interval"), C.DEFAULT_SWEEP_INTERVAL)
        ),
        sweep_batch=sweep_batch,
        sweep_queue=sweep_queue,
        allow_pickle=allow_pickle,
        claim_timeout=_number(
            "safe_time_claim_timeout", _default(get("safe_time_claim_timeout"), C.DEFAULT_CLAIM_TIMEOUT)
        ),
        lock_ttl=lock_ttl,
        store_timeout=_number(
            "safe_time_store_timeout",
            _default(get("safe_time_store_timeout"), C.DEFAULT_STORE_TIMEOUT),
            positive=False,
        ),
        max_clock_skew=max_clock_skew,
        delay_retention=delay_retention,
        delivery_grace=_number(
            "safe_time_delivery_grace", _default(get("safe_time_delivery_grace"), C.DEFAULT_DELIVERY_GRACE)
        ),
        visibility_timeout=visibility_timeout,
        broker_kind=kind,
        broker_consumer_timeout=consumer_timeout,
        delay_threshold_reason=threshold_reason,
        redis_cluster=redis_cluster,
        sweep_max_ahead=sweep_max_ahead,
        coordination=coordination,
        coordination_url=coordination_url,
        coordination_locks=coordination_locks,
        coordination_io_timeout=coordination_io_timeout,
        coordination_statement_timeout=coordination_statement_timeout,
        beat_history_size=beat_history_size,
        beat_audit_size=beat_audit_size,
    )


def _count(name: str, raw: Any, default: int) -> int:
    """A setting that is a count of kept records: a whole number, 0 or more."""
    value = _default(raw, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ImproperlyConfigured(name, f"must be a whole number, 0 or more, got {value!r}")
    return value


def broker_kind(scheme: str) -> str:
    """``amqp``, ``redis``, ``sqs`` or ``other`` for a broker_url scheme (without its ``+driver`` part)."""
    if scheme in C.AMQP_SCHEMES:
        return C.BROKER_AMQP
    if scheme in C.REDIS_BROKER_SCHEMES:
        return C.BROKER_REDIS
    if scheme == "sqs":
        return C.BROKER_SQS
    return C.BROKER_OTHER


def _delay_threshold(
    raw: Any, kind: str, visibility_timeout: float | None, consumer_timeout: float | None
) -> tuple[float, str]:
    """The threshold and the reason for it: every countdown at or below it stays in the broker, so it
    must stay below whatever makes the broker hand a held message out again (visibility timeout) or
    close the worker's channel (RabbitMQ's consumer timeout), and within SQS's longest delay."""
    if raw is None:
        limits = [f"{C.DEFAULT_DELAY_THRESHOLD_CAP:g}"]
        threshold = C.DEFAULT_DELAY_THRESHOLD_CAP
        if visibility_timeout is not None:
            threshold = min(threshold, visibility_timeout / 2.0)
            limits.append(f"visibility_timeout {visibility_timeout:g} s / 2")
        if consumer_timeout is not None:
            threshold = min(threshold, consumer_timeout / 2.0)
            limits.append(f"safe_time_broker_consumer_timeout {consumer_timeout:g} s / 2")
        if kind == C.BROKER_SQS:
            limits.append(f"SQS DelaySeconds max {C.SQS_MAX_DELAY_SECONDS:g} s")
        return threshold, f"default: min({', '.join(limits)})"

    threshold = _number("safe_time_delay_threshold", raw, positive=False)
    if visibility_timeout is not None and threshold >= visibility_timeout:
        raise ImproperlyConfigured(
            "safe_time_delay_threshold",
            f"{threshold:g} s is at or above the broker's visibility_timeout "
            f"({visibility_timeout:g} s): such countdowns would be redelivered and run twice",
        )
    if consumer_timeout is not None and threshold >= consumer_timeout:
        raise ImproperlyConfigured(
            "safe_time_delay_threshold",
            f"{threshold:g} s is at or above safe_time_broker_consumer_timeout ({consumer_timeout:g} s): a worker "
            "holding such a countdown unacked would have its channel closed by RabbitMQ (PRECONDITION_FAILED) "
            "and exit; lower the threshold, or raise consumer_timeout on the server and in that setting",
        )
    if kind == C.BROKER_SQS and threshold > C.SQS_MAX_DELAY_SECONDS:
        raise ImproperlyConfigured(
            "safe_time_delay_threshold",
            f"{threshold:g} s is above SQS's longest message delay (DelaySeconds at most "
            f"{C.SQS_MAX_DELAY_SECONDS:g} s): longer delays belong in the store",
        )
    return threshold, "set explicitly (safe_time_delay_threshold)"


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _number(key: str, value: Any, *, positive: bool = True) -> float:
    """Accept ints, floats, numeric strings and timedeltas (as Celery does for durations)."""
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    if isinstance(value, bool):
        raise ImproperlyConfigured(key, f"must be a number of seconds, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ImproperlyConfigured(key, f"must be a number of seconds, got {value!r}") from None
    if not math.isfinite(number):
        raise ImproperlyConfigured(key, f"must be finite, got {value!r}")
    if positive and number <= 0:
        raise ImproperlyConfigured(key, f"must be greater than zero, got {value!r}")
    if not positive and number < 0:
        raise ImproperlyConfigured(key, f"must not be negative, got {value!r}")
    return number


def seconds_argument(name: str, value: Any, *, positive: bool = False, durations: bool = False) -> float:
    """``value`` of the call's parameter ``name`` as seconds, or a ``TypeError``/``ValueError`` naming it.

    An int or a float, as Celery takes ``countdown`` (a string such as ``"10"`` is refused here rather
    than deep in Celery or in the store); ``durations`` also takes a ``timedelta``. Never a bool, never
    NaN or infinite; ``positive`` refuses zero and negatives.
    """
    if durations and isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kinds = "an int, a float or a timedelta" if durations else "an int or a float"
        raise TypeError(f"{name} must be a number of seconds ({kinds}), got {value!r} ({type(value).__name__})")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if positive and seconds <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def instant_argument(name: str, value: Any) -> datetime:
    """``value`` of the call's parameter ``name`` (a datetime or an ISO 8601 string, as Celery takes
    ``eta``) as an aware UTC datetime, or a ``TypeError``/``ValueError`` naming it."""
    if not isinstance(value, (datetime, str)):
        raise TypeError(f"{name} must be a datetime or an ISO 8601 string, got {value!r} ({type(value).__name__})")
    try:
        return as_utc(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a datetime or an ISO 8601 string, got {value!r}") from None


def expires_argument(value: Any) -> float | datetime:
    """``expires`` as Celery takes it: seconds from now (an int or a float) or an instant (a datetime
    or an ISO 8601 string); a ``TypeError``/``ValueError`` naming ``expires`` otherwise."""
    if isinstance(value, (datetime, str)):
        return instant_argument("expires", value)
    return seconds_argument("expires", value)


_DURATION = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]?)")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a plain number (``3600``) or one with a unit (``45s``, ``30m``, ``12h``, ``7d``, ``2w``).

    For command-line options; settings take numbers and timedeltas (see :func:`_number`).
    Raises ``ValueError`` with the accepted forms on anything else, zero and negatives included.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None or match["unit"] not in ("", *C.DURATION_UNITS):
        units = ", ".join(C.DURATION_UNITS)
        raise ValueError(f"{text!r} is not a duration: use seconds (3600) or a number with a unit ({units}), e.g. 7d")
    seconds = float(match["number"]) * C.DURATION_UNITS.get(match["unit"], 1.0)
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


def _redis_url(key: str, url: Any) -> str:
    if not isinstance(url, str) or not url:
        raise ImproperlyConfigured(key, f"must be a URL string, got {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in C.REDIS_URL_SCHEMES:
        raise ImproperlyConfigured(
            key,
            f"unknown scheme {scheme!r}; use one of {', '.join(sorted(s + '://' for s in C.REDIS_URL_SCHEMES))}",
        )
    return url


def _store_url(key: str, url: Any) -> str:
    if not isinstance(url, str) or not url:
        raise ImproperlyConfigured(key, f"must be a URL string or 'django', got {url!r}")
    if url == C.DJANGO_STORE:
        return url
    scheme = urlsplit(url).scheme.lower().split("+")[0]
    if scheme not in C.STORE_URL_SCHEMES:
        raise ImproperlyConfigured(
            key,
            f"unknown scheme {scheme!r}; use 'django' or a SQLAlchemy URL ({', '.join(sorted(C.STORE_URL_SCHEMES))})",
        )
    return url


def _coordination(value: Any, store_url: str) -> tuple[str, str]:
    """``safe_time_coordination_url``: unset -> Redis; ``"store"`` -> the store's PostgreSQL database;
    a ``postgresql://`` URL.

    MySQL/MariaDB are refused at startup rather than half supported: ``GET_LOCK`` is per session as
    PostgreSQL's advisory locks are, but the backend is built on ``INSERT ... ON CONFLICT ... RETURNING``
    and sequences for fencing numbers, which MySQL lacks. The delay store works on MySQL/MariaDB.
    """
    key = "safe_time_coordination_url"
    if value is None or value == C.COORDINATION_REDIS:
        return C.COORDINATION_REDIS, ""
    if not isinstance(value, str) or not value:
        raise ImproperlyConfigured(key, f"must be 'store' or a postgresql:// URL, got {value!r}")
    url = value
    if value == C.COORDINATION_STORE:
        if store_url == C.DJANGO_STORE:
            return C.COORDINATION_POSTGRES, C.DJANGO_STORE
        url = store_url
    scheme = urlsplit(url).scheme.lower().split("+")[0]
    if scheme in C.COORDINATION_POSTGRES_SCHEMES:
        return C.COORDINATION_POSTGRES, url
    where = (
        f"the store ({scheme}://) is not PostgreSQL"
        if value == C.COORDINATION_STORE
        else f"{scheme}:// is not PostgreSQL"
    )
    if scheme in ("mysql", "mariadb"):
        where += " (MySQL/MariaDB cannot coordinate: use Redis or a PostgreSQL database)"
    raise ImproperlyConfigured(key, f"{where}; use 'store' with a PostgreSQL store, or a postgresql:// URL")


def _store_namespace(value: Any, app_name: str | None) -> str:
    """``safe_time_store_namespace``: set, or the app's main name, or ``"celery"``."""
    if value is None:
        value = app_name or C.DEFAULT_STORE_NAMESPACE
        # Celery("proj") -> "proj"; a name longer than the column keeps its end (the module path's tail).
        return str(value)[-C.DELAY_NAMESPACE_LENGTH :]
    if not isinstance(value, str) or not value.strip() or len(value) > C.DELAY_NAMESPACE_LENGTH:
        raise ImproperlyConfigured(
            "safe_time_store_namespace",
            f"must be a non-empty string of at most {C.DELAY_NAMESPACE_LENGTH} characters, got {value!r}",
        )
    return value
