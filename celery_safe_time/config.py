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
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

from . import constants as C
from .clock import as_utc
from .exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

#: Duration suffixes of ``delays purge --older-than`` (``7d``, ``12h``, ``30m``, ``45s``, ``2w``).
DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}

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
    #: The rows of the store this app claims, lists, counts, cancels and purges (its own and the shared one).
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
    #: ``safe_time_beat_shards``: runtime entries hashed into this many shards, each with its own lease.
    beat_shards: int = C.DEFAULT_BEAT_SHARDS
    #: ``safe_time_beat_history_size``: runs kept per beat entry (0: no run history).
    beat_history_size: int = C.DEFAULT_BEAT_HISTORY_SIZE
    #: ``safe_time_beat_audit_size``: changes kept per beat entry (0: no change audit).
    beat_audit_size: int = C.DEFAULT_BEAT_AUDIT_SIZE

    def key(self, template: str, **parts: Any) -> str:
        """Return a prefixed Redis key from a template of :mod:`celery_safe_time.constants`.

        On a Redis Cluster the name carries a hash tag (:func:`cluster_key_name`); elsewhere it is the
        plain template, so an upgrade never renames a key under a running beat.
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
        """Seconds before its due time a row may be claimed and published with ``eta=due_at``: a small share
        of a consumer timeout (a test broker with an 8 s timeout must not lose workers to it)."""
        if self.broker_consumer_timeout is None:
            return C.SWEEP_LOOKAHEAD
        return min(C.SWEEP_LOOKAHEAD, self.broker_consumer_timeout * SWEEP_LOOKAHEAD_CONSUMER_SHARE)

    @property
    def sweep_lookahead_max(self) -> float:
        """The most the adaptive look-ahead may grow to under a backlog: at most ``SWEEP_LOOKAHEAD_MAX`` and
        a share of the visibility timeout (Redis, SQS redeliver after it) and of the consumer timeout."""
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
            app.conf.get,
            broker_url=first_broker_url(app),
            transport_options=dict(app.conf.broker_transport_options or {}),
            app_name=app.main,
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
    messages = unknown_setting_warnings(_setting_names(app), known_setting_names()) + _outside_namespace(app)
    if app.conf.get("safe_time_store_url") is None and _reads_django_settings(app):
        prefix = _namespace_prefix(app)
        messages.append(
            f"{prefix}SAFE_TIME_STORE_URL is not set: stored delays go to {C.DEFAULT_STORE_URL}, a file in the "
            f"current directory; set {prefix}SAFE_TIME_STORE_URL = 'django' to keep them in the project's database"
        )
    return messages


@functools.cache
def known_setting_names() -> frozenset[str]:
    """Every ``safe_time_*`` key there is: the rows of :data:`_SETTINGS` (so a setting added there is
    known here too), and the Django admin's app setting."""
    return frozenset({C.SETTING_PREFIX + row.field for row in _SETTINGS} | {C.DJANGO_APP_SETTING.lower()})


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


@dataclasses.dataclass(frozen=True)
class _Setting:
    """One row of :data:`_SETTINGS`: the ``safe_time_<field>`` key and what becomes of its value.

    ``default`` is the value of an unset key, or a function of the values read so far; ``parse``
    turns a set value into the field's (raising :class:`ImproperlyConfigured` naming the key), and
    ``rule`` checks the resulting value against the broker and the settings read before it.
    """

    field: str
    default: Any = None
    parse: Callable[[str, Any], Any] | None = None
    rule: Callable[[str, Any, dict[str, Any]], Any] | None = None


def parse_config(
    get: Callable[[str], Any],
    *,
    broker_url: str = "",
    transport_options: dict[str, Any] | None = None,
    app_name: str | None = None,
) -> SafeTimeConfig:
    """Validate raw settings read through ``get(key)`` and build a :class:`SafeTimeConfig`.

    Pure: takes the lookup function so tests can pass a dict's ``get``. Each row of :data:`_SETTINGS`
    reads one key, in order, so a rule sees the settings of the rows above it.
    """
    scheme = urlsplit(broker_url).scheme.split("+")[0].lower() if broker_url else ""
    kind = broker_kind(scheme)
    values: dict[str, Any] = {
        "broker_kind": kind,
        "visibility_timeout": _visibility_timeout(scheme, kind, transport_options or {}),
        "_redis_broker_url": broker_url if scheme in ("redis", "rediss") else None,
        "_app_name": app_name,
    }
    for row in _SETTINGS:
        key = C.SETTING_PREFIX + row.field
        raw = get(key)
        if raw is None:
            value = row.default(values) if callable(row.default) else row.default
        else:
            value = raw if row.parse is None else row.parse(key, raw)
        values[row.field] = value if row.rule is None else row.rule(key, value, values)
    values["delay_threshold_reason"] = (
        "set explicitly (safe_time_delay_threshold)"
        if get("safe_time_delay_threshold") is not None
        else _default_threshold(values)[1]
    )
    values["coordination"] = C.COORDINATION_POSTGRES if values["coordination_url"] else C.COORDINATION_REDIS
    values["redis_cluster"] = _on_cluster(values["redis_url"])
    fields = {field.name for field in dataclasses.fields(SafeTimeConfig)}
    return SafeTimeConfig(**{name: value for name, value in values.items() if name in fields})


def _visibility_timeout(scheme: str, kind: str, transport_options: dict[str, Any]) -> float | None:
    """The broker's visibility timeout (kombu's default unless set), or None on a broker without one."""
    if scheme not in C.VISIBILITY_TIMEOUT_SCHEMES:
        return None
    key = "broker_transport_options.visibility_timeout"
    default = C.KOMBU_SQS_DEFAULT_VISIBILITY_TIMEOUT if kind == C.BROKER_SQS else C.KOMBU_DEFAULT_VISIBILITY_TIMEOUT
    timeout = _number(key, transport_options.get("visibility_timeout", default), positive=True)
    if kind == C.BROKER_SQS and timeout > C.SQS_MAX_VISIBILITY_TIMEOUT:
        raise ImproperlyConfigured(
            key,
            f"{timeout:g} s is above SQS's maximum visibility timeout "
            f"({C.SQS_MAX_VISIBILITY_TIMEOUT:g} s, 12 h): SQS refuses it",
        )
    return timeout


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


def _checked(wanted: str, accepts: Callable[[Any], bool]) -> Callable[[str, Any], Any]:
    """A parser keeping a value ``accepts`` takes, else raising "<key>: must be <wanted>, got <value>"."""

    def parse(key: str, value: Any) -> Any:
        if not accepts(value):
            raise ImproperlyConfigured(key, f"must be {wanted}, got {value!r}")
        return value

    return parse


def _choice(options: Sequence[str]) -> Callable[[str, Any], Any]:
    return _checked(f"one of {', '.join(options)}", lambda value: value in options)


def _whole(minimum: int, wanted: str) -> Callable[[str, Any], Any]:
    return _checked(wanted, lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= minimum)


def _text(wanted: str) -> Callable[[str, Any], Any]:
    return _checked(wanted, lambda value: isinstance(value, str) and bool(value))


def _consumer_timeout(values: dict[str, Any]) -> float | None:
    # Set, it is honoured on any broker: a failover list or a proxy may hide RabbitMQ behind another URL.
    return float(C.DEFAULT_AMQP_CONSUMER_TIMEOUT) if values["broker_kind"] == C.BROKER_AMQP else None


def _default_redis_url(values: dict[str, Any]) -> str:
    if values["_redis_broker_url"] is not None:
        return str(values["_redis_broker_url"])
    if values["coordination_url"]:
        return ""  # nothing of this package talks to Redis
    raise ImproperlyConfigured(
        "safe_time_redis_url",
        "is required when broker_url is not a redis:// or rediss:// URL "
        "(or set safe_time_coordination_url to a PostgreSQL database)",
    )


def _redis_url(key: str, url: Any, values: dict[str, Any]) -> str:
    if url == "" and values["coordination_url"]:
        return ""
    if not isinstance(url, str) or not url:
        raise ImproperlyConfigured(key, f"must be a URL string, got {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in C.REDIS_URL_SCHEMES:
        raise ImproperlyConfigured(
            key,
            f"unknown scheme {scheme!r}; use one of {', '.join(sorted(s + '://' for s in C.REDIS_URL_SCHEMES))}",
        )
    return url


def _on_cluster(redis_url: str) -> bool:
    return bool(redis_url) and urlsplit(redis_url).scheme.lower() in C.REDIS_CLUSTER_SCHEMES


def _key_prefix_rule(key: str, prefix: str, values: dict[str, Any]) -> str:
    if _on_cluster(values["redis_url"]) and ("{" in prefix or "}" in prefix):
        raise ImproperlyConfigured(
            key,
            f"{prefix!r} holds a brace; on a Redis Cluster celery-safe-time places the hash tags itself "
            "(a prefix tag would put every key in one slot, a lone brace would split a script's keys)",
        )
    return prefix


def _default_threshold(values: dict[str, Any]) -> tuple[float, str]:
    """The threshold of an unset ``safe_time_delay_threshold`` and the reason for it: every countdown
    at or below it stays in the broker, so it stays below whatever makes the broker hand a held
    message out again (visibility timeout) or close the worker's channel (RabbitMQ's consumer
    timeout), and within SQS's longest delay."""
    visibility_timeout, consumer_timeout = values["visibility_timeout"], values["broker_consumer_timeout"]
    limits = [f"{C.DEFAULT_DELAY_THRESHOLD_CAP:g}"]
    threshold = C.DEFAULT_DELAY_THRESHOLD_CAP
    if visibility_timeout is not None:
        threshold = min(threshold, visibility_timeout / 2.0)
        limits.append(f"visibility_timeout {visibility_timeout:g} s / 2")
    if consumer_timeout is not None:
        threshold = min(threshold, consumer_timeout / 2.0)
        limits.append(f"safe_time_broker_consumer_timeout {consumer_timeout:g} s / 2")
    if values["broker_kind"] == C.BROKER_SQS:
        limits.append(f"SQS DelaySeconds max {C.SQS_MAX_DELAY_SECONDS:g} s")
    return threshold, f"default: min({', '.join(limits)})"


def _threshold_rule(key: str, threshold: float, values: dict[str, Any]) -> float:
    visibility_timeout, consumer_timeout = values["visibility_timeout"], values["broker_consumer_timeout"]
    if visibility_timeout is not None and threshold >= visibility_timeout:
        raise ImproperlyConfigured(
            key,
            f"{threshold:g} s is at or above the broker's visibility_timeout "
            f"({visibility_timeout:g} s): such countdowns would be redelivered and run twice",
        )
    if consumer_timeout is not None and threshold >= consumer_timeout:
        raise ImproperlyConfigured(
            key,
            f"{threshold:g} s is at or above safe_time_broker_consumer_timeout ({consumer_timeout:g} s): a worker "
            "holding such a countdown unacked would have its channel closed by RabbitMQ (PRECONDITION_FAILED) "
            "and exit; lower the threshold, or raise consumer_timeout on the server and in that setting",
        )
    if values["broker_kind"] == C.BROKER_SQS and threshold > C.SQS_MAX_DELAY_SECONDS:
        raise ImproperlyConfigured(
            key,
            f"{threshold:g} s is above SQS's longest message delay (DelaySeconds at most "
            f"{C.SQS_MAX_DELAY_SECONDS:g} s): longer delays belong in the store",
        )
    return threshold


def _lock_ttl_rule(key: str, lock_ttl: float, values: dict[str, Any]) -> float:
    # A delivery that finds its run alive elsewhere comes back within lock_ttl / 2 as a broker
    # countdown, which a worker holds unacked: it must stay below the consumer timeout too.
    recheck = lock_ttl * C.DELIVERY_RUNNING_RECHECK * 1.5
    consumer_timeout = values["broker_consumer_timeout"]
    if consumer_timeout is not None and recheck >= consumer_timeout:
        raise ImproperlyConfigured(
            key,
            f"{lock_ttl:g} s makes re-queued deliveries wait up to {recheck:g} s in a worker, at or above "
            f"safe_time_broker_consumer_timeout ({consumer_timeout:g} s): RabbitMQ would close the worker's channel",
        )
    return lock_ttl


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


def _coordination_url(key: str, value: Any, values: dict[str, Any]) -> str:
    """``safe_time_coordination_url``: unset -> Redis (""); ``"store"`` -> the store's PostgreSQL
    database (``"django"`` for a Django store); a ``postgresql://`` URL.

    MySQL/MariaDB are refused at startup rather than half supported: ``GET_LOCK`` is per session as
    PostgreSQL's advisory locks are, but the backend is built on ``INSERT ... ON CONFLICT ... RETURNING``
    and sequences for fencing numbers, which MySQL lacks. The delay store works on MySQL/MariaDB.
    """
    if value is None or value == C.COORDINATION_REDIS:
        return ""
    if not isinstance(value, str) or not value:
        raise ImproperlyConfigured(key, f"must be 'store' or a postgresql:// URL, got {value!r}")
    store_url = values["store_url"]
    if value == C.COORDINATION_STORE and store_url == C.DJANGO_STORE:
        return str(C.DJANGO_STORE)
    url = store_url if value == C.COORDINATION_STORE else value
    scheme = urlsplit(url).scheme.lower().split("+")[0]
    if scheme in C.COORDINATION_POSTGRES_SCHEMES:
        return str(url)
    where = f"the store ({scheme}://)" if value == C.COORDINATION_STORE else f"{scheme}://"
    where += " is not PostgreSQL"
    if scheme in ("mysql", "mariadb"):
        where += " (MySQL/MariaDB cannot coordinate: use Redis or a PostgreSQL database)"
    raise ImproperlyConfigured(key, f"{where}; use 'store' with a PostgreSQL store, or a postgresql:// URL")


def _default_store_namespace(values: dict[str, Any]) -> str:
    # Celery("proj") -> "proj"; a name longer than the column keeps its end (the module path's tail).
    return str(values["_app_name"] or C.DEFAULT_STORE_NAMESPACE)[-C.DELAY_NAMESPACE_LENGTH :]


_POSITIVE_INT = _whole(1, "a positive integer")
_KEPT_COUNT = _whole(0, "a whole number, 0 or more")
_NOT_NEGATIVE = functools.partial(_number, positive=False)
_STORE_NAMESPACE = _checked(
    f"a non-empty string of at most {C.DELAY_NAMESPACE_LENGTH} characters",
    lambda value: isinstance(value, str) and bool(value.strip()) and len(value) <= C.DELAY_NAMESPACE_LENGTH,
)

#: Every ``safe_time_*`` setting, in the order read: a row's rule and default see the rows above it.
_SETTINGS = (
    _Setting("broker_consumer_timeout", _consumer_timeout, _number),
    _Setting("store_url", C.DEFAULT_STORE_URL, _store_url),
    _Setting("coordination_url", None, None, _coordination_url),
    _Setting("coordination_locks", C.PG_LOCK_MODE_LEASE, _choice(C.PG_LOCK_MODES)),
    _Setting("coordination_io_timeout", C.DEFAULT_COORDINATION_IO_TIMEOUT, _number),
    _Setting("coordination_statement_timeout", None, _number),
    _Setting("redis_url", _default_redis_url, None, _redis_url),
    _Setting("key_prefix", C.DEFAULT_KEY_PREFIX, _text("a non-empty string"), _key_prefix_rule),
    _Setting("misfire", C.DEFAULT_MISFIRE, _choice(sorted(C.MISFIRE_POLICIES))),
    _Setting("misfire_grace", C.DEFAULT_MISFIRE_GRACE, _number),
    _Setting("delay_threshold", lambda values: _default_threshold(values)[0], _NOT_NEGATIVE, _threshold_rule),
    _Setting("lock_ttl", C.DEFAULT_LOCK_TTL, _number, _lock_ttl_rule),
    _Setting("store_namespace", _default_store_namespace, _STORE_NAMESPACE),
    _Setting("sweep_queue", C.DEFAULT_SWEEP_QUEUE, _text("a queue name or None")),
    _Setting("sweep_batch", C.DEFAULT_SWEEP_BATCH, _POSITIVE_INT),
    _Setting("sweep_max_ahead", C.DEFAULT_SWEEP_MAX_AHEAD, _POSITIVE_INT),
    _Setting("beat_shards", C.DEFAULT_BEAT_SHARDS, _POSITIVE_INT),
    _Setting("beat_history_size", C.DEFAULT_BEAT_HISTORY_SIZE, _KEPT_COUNT),
    _Setting("beat_audit_size", C.DEFAULT_BEAT_AUDIT_SIZE, _KEPT_COUNT),
    _Setting("allow_pickle", C.DEFAULT_ALLOW_PICKLE, _checked("True or False", lambda value: isinstance(value, bool))),
    _Setting("max_clock_skew", C.DEFAULT_MAX_CLOCK_SKEW, _NOT_NEGATIVE),
    _Setting("delay_retention", C.DEFAULT_DELAY_RETENTION, _number),
    _Setting("beat_lease", C.DEFAULT_BEAT_LEASE, _number),
    _Setting("sweep_interval", C.DEFAULT_SWEEP_INTERVAL, _number),
    _Setting("claim_timeout", C.DEFAULT_CLAIM_TIMEOUT, _number),
    _Setting("store_timeout", C.DEFAULT_STORE_TIMEOUT, _NOT_NEGATIVE),
    _Setting("delivery_grace", C.DEFAULT_DELIVERY_GRACE, _number),
)


def broker_kind(scheme: str) -> str:
    """``amqp``, ``redis``, ``sqs`` or ``other`` for a broker_url scheme (without its ``+driver`` part)."""
    if scheme in C.AMQP_SCHEMES:
        return C.BROKER_AMQP
    if scheme in C.REDIS_BROKER_SCHEMES:
        return C.BROKER_REDIS
    if scheme == "sqs":
        return C.BROKER_SQS
    return C.BROKER_OTHER


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
    if match is None or match["unit"] not in ("", *DURATION_UNITS):
        units = ", ".join(DURATION_UNITS)
        raise ValueError(f"{text!r} is not a duration: use seconds (3600) or a number with a unit ({units}), e.g. 7d")
    seconds = float(match["number"]) * DURATION_UNITS.get(match["unit"], 1.0)
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds
