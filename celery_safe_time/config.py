"""The ``safe_time_*`` settings, parsed once per app into a frozen, typed object.

Celery maps Django's ``CELERY_SAFE_TIME_*`` names onto the lowercase keys when the app
was configured with ``namespace="CELERY"``, so reading ``app.conf.get(key)`` covers both.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

from . import constants as C
from .exceptions import ImproperlyConfigured

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
    sweep_interval: float = C.DEFAULT_SWEEP_INTERVAL
    sweep_batch: int = C.DEFAULT_SWEEP_BATCH
    sweep_queue: str | None = C.DEFAULT_SWEEP_QUEUE
    allow_pickle: bool = C.DEFAULT_ALLOW_PICKLE
    claim_timeout: float = C.DEFAULT_CLAIM_TIMEOUT
    lock_ttl: float = C.DEFAULT_LOCK_TTL
    max_clock_skew: float = C.DEFAULT_MAX_CLOCK_SKEW
    #: Seconds a sent/cancelled/expired row is kept before the sweep deletes it; None keeps them forever.
    delay_retention: float | None = C.DEFAULT_DELAY_RETENTION
    #: Seconds after its due time (or its last publish) a sent but never started row is published again.
    delivery_grace: float = C.DEFAULT_DELIVERY_GRACE
    #: The broker's visibility timeout, or None when the broker has none (AMQP).
    visibility_timeout: float | None = None

    def key(self, template: str, **parts: Any) -> str:
        """Return a prefixed Redis key from a template of :mod:`celery_safe_time.constants`."""
        return self.key_prefix + template.format(**parts)

    @property
    def beat_renew_interval(self) -> float:
        return self.beat_lease / 3.0


def mask_url(url: str | None) -> str:
    """Return ``url`` with any password replaced by ``***`` (safe for logs and banners)."""
    if not url:
        return ""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    hostinfo = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username or ''}:***@{hostinfo}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def get_config(app: Celery) -> SafeTimeConfig:
    """Return the app's parsed settings, parsing and validating them on first use."""
    try:
        return _CACHE[app]
    except KeyError:
        pass
    config = parse_config(app.conf.get, broker_url=_broker_url(app), transport_options=_transport_options(app))
    _CACHE[app] = config
    return config


def reset_config(app: Celery) -> None:
    """Forget the cached settings of ``app`` (tests change ``app.conf`` between cases)."""
    _CACHE.pop(app, None)


def _broker_url(app: Celery) -> str:
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
) -> SafeTimeConfig:
    """Validate raw settings read through ``get(key)`` and build a :class:`SafeTimeConfig`.

    Pure: takes the lookup function so tests can pass a dict's ``get``.
    """
    transport_options = transport_options or {}
    scheme = urlsplit(broker_url).scheme.split("+")[0].lower() if broker_url else ""

    visibility_timeout: float | None = None
    if scheme in C.VISIBILITY_TIMEOUT_SCHEMES:
        visibility_timeout = _number(
            "broker_transport_options.visibility_timeout",
            transport_options.get("visibility_timeout", C.KOMBU_DEFAULT_VISIBILITY_TIMEOUT),
            positive=True,
        )

    redis_url = get("safe_time_redis_url")
    if redis_url is None:
        if scheme in ("redis", "rediss"):
            redis_url = broker_url
        else:
            raise ImproperlyConfigured(
                "safe_time_redis_url",
                "is required when broker_url is not a redis:// or rediss:// URL",
            )
    redis_url = _redis_url("safe_time_redis_url", redis_url)

    key_prefix = get("safe_time_key_prefix")
    if key_prefix is None:
        key_prefix = C.DEFAULT_KEY_PREFIX
    if not isinstance(key_prefix, str) or not key_prefix:
        raise ImproperlyConfigured("safe_time_key_prefix", f"must be a non-empty string, got {key_prefix!r}")

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

    threshold_raw = get("safe_time_delay_threshold")
    if threshold_raw is None:
        delay_threshold = C.DEFAULT_DELAY_THRESHOLD_CAP
        if visibility_timeout is not None:
            delay_threshold = min(delay_threshold, visibility_timeout / 2.0)
    else:
        delay_threshold = _number("safe_time_delay_threshold", threshold_raw, positive=False)
        if visibility_timeout is not None and delay_threshold >= visibility_timeout:
            raise ImproperlyConfigured(
                "safe_time_delay_threshold",
                f"{delay_threshold:g} s is at or above the broker's visibility_timeout "
                f"({visibility_timeout:g} s): such countdowns would be redelivered and run twice",
            )

    store_url = _default(get("safe_time_store_url"), C.DEFAULT_STORE_URL)
    store_url = _store_url("safe_time_store_url", store_url)

    sweep_queue = get("safe_time_sweep_queue")
    if sweep_queue is not None and (not isinstance(sweep_queue, str) or not sweep_queue):
        raise ImproperlyConfigured("safe_time_sweep_queue", f"must be a queue name or None, got {sweep_queue!r}")

    sweep_batch = _default(get("safe_time_sweep_batch"), C.DEFAULT_SWEEP_BATCH)
    if isinstance(sweep_batch, bool) or not isinstance(sweep_batch, int) or sweep_batch <= 0:
        raise ImproperlyConfigured("safe_time_sweep_batch", f"must be a positive integer, got {sweep_batch!r}")

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
        sweep_interval=_number(
            "safe_time_sweep_interval", _default(get("safe_time_sweep_interval"), C.DEFAULT_SWEEP_INTERVAL)
        ),
        sweep_batch=sweep_batch,
        sweep_queue=sweep_queue,
        allow_pickle=allow_pickle,
        claim_timeout=_number(
            "safe_time_claim_timeout", _default(get("safe_time_claim_timeout"), C.DEFAULT_CLAIM_TIMEOUT)
        ),
        lock_ttl=_number("safe_time_lock_ttl", _default(get("safe_time_lock_ttl"), C.DEFAULT_LOCK_TTL)),
        max_clock_skew=max_clock_skew,
        delay_retention=delay_retention,
        delivery_grace=_number(
            "safe_time_delivery_grace", _default(get("safe_time_delivery_grace"), C.DEFAULT_DELIVERY_GRACE)
        ),
        visibility_timeout=visibility_timeout,
    )


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
