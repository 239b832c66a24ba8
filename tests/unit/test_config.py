from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time.config import SafeTimeConfig, get_config, parse_config, parse_duration, reset_config
from celery_safe_time.exceptions import ImproperlyConfigured, SafeTimeError

REDIS = "redis://127.0.0.1:6379/0"


def parse(broker: str = REDIS, transport: dict[str, Any] | None = None, **settings: Any) -> SafeTimeConfig:
    return parse_config(settings.get, broker_url=broker, transport_options=transport)


def test_defaults_follow_the_design() -> None:
    cfg = parse()
    assert cfg.redis_url == REDIS  # falls back to a redis:// broker_url
    assert cfg.key_prefix == "safe_time:"
    assert cfg.beat_lease == 30
    assert cfg.misfire == "run_once"
    assert cfg.misfire_grace is None
    assert cfg.delay_threshold == 900  # min(900, 3600 / 2)
    assert cfg.store_url == "sqlite:///celery_safe_time.sqlite3"
    assert cfg.sweep_interval == 5
    assert cfg.sweep_batch == 500
    assert cfg.sweep_queue is None
    assert cfg.allow_pickle is False
    assert cfg.claim_timeout == 300
    assert cfg.lock_ttl == 60
    assert cfg.max_clock_skew == 0.1
    assert cfg.visibility_timeout == 3600
    assert cfg.beat_renew_interval == 10
    assert cfg.delay_retention is None  # finished rows are kept forever unless asked


def test_threshold_defaults_to_half_the_visibility_timeout() -> None:
    assert parse(transport={"visibility_timeout": 600}).delay_threshold == 300
    assert parse(transport={"visibility_timeout": 7200}).delay_threshold == 900


AMQP = "amqp://guest@localhost//"


@pytest.mark.parametrize("broker", [AMQP, "pyamqp://h//", "amqps://h//", "librabbitmq://h//"])
def test_amqp_brokers_get_a_30_minute_consumer_timeout_and_half_of_it_caps_the_threshold(broker: str) -> None:
    cfg = parse(broker=broker, safe_time_redis_url=REDIS)
    assert cfg.broker_kind == "amqp"
    assert cfg.visibility_timeout is None  # RabbitMQ has none; its consumer timeout is the limit
    assert cfg.broker_consumer_timeout == 1800
    assert cfg.delay_threshold == 900  # min(900, 1800 / 2)
    assert "consumer_timeout 1800 s / 2" in cfg.delay_threshold_reason


def test_a_lower_consumer_timeout_lowers_the_default_threshold_and_the_sweep_lookahead() -> None:
    cfg = parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_broker_consumer_timeout=600)
    assert cfg.delay_threshold == 300
    assert cfg.sweep_lookahead == 2.0
    short = parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_broker_consumer_timeout=8, safe_time_lock_ttl=6)
    assert short.delay_threshold == 4
    assert short.sweep_lookahead == pytest.approx(0.8)  # a tenth of the timeout, not 2 s


def test_no_consumer_timeout_off_amqp_unless_set() -> None:
    assert parse().broker_consumer_timeout is None
    assert parse().broker_kind == "redis"
    assert parse().sweep_lookahead == C.SWEEP_LOOKAHEAD
    assert parse(broker="memory://", safe_time_redis_url=REDIS).broker_kind == "other"
    cfg = parse(safe_time_broker_consumer_timeout=timedelta(minutes=10))
    assert (cfg.broker_consumer_timeout, cfg.delay_threshold) == (600, 300)


def test_explicit_threshold_below_the_consumer_timeout_is_kept() -> None:
    cfg = parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_delay_threshold=1799)
    assert cfg.delay_threshold == 1799
    assert cfg.delay_threshold_reason == "set explicitly (safe_time_delay_threshold)"
    raised = parse(
        broker=AMQP,
        safe_time_redis_url=REDIS,
        safe_time_broker_consumer_timeout=86400 * 365,
        safe_time_delay_threshold=86400,
    )
    assert raised.delay_threshold == 86400


@pytest.mark.parametrize("threshold", [1800, 1800.0, 86400, "3600"])
def test_explicit_threshold_at_or_above_the_consumer_timeout_names_both_keys(threshold: Any) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_delay_threshold=threshold)
    assert info.value.key == "safe_time_delay_threshold"
    assert "safe_time_broker_consumer_timeout (1800 s)" in str(info.value)
    assert "PRECONDITION_FAILED" in str(info.value)


@pytest.mark.parametrize("value", [0, -1, "soon", True, float("inf")])
def test_invalid_consumer_timeout_is_named(value: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^safe_time_broker_consumer_timeout:"):
        parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_broker_consumer_timeout=value)


def test_lock_ttl_whose_requeues_would_outlast_the_consumer_timeout_is_refused() -> None:
    # A delivery re-queued while its run is alive waits up to lock_ttl / 2 in a worker, unacked.
    with pytest.raises(ImproperlyConfigured, match=r"^safe_time_lock_ttl:.*safe_time_broker_consumer_timeout"):
        parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_broker_consumer_timeout=20, safe_time_lock_ttl=60)
    assert parse(broker=AMQP, safe_time_redis_url=REDIS, safe_time_broker_consumer_timeout=20, safe_time_lock_ttl=30)


SQS = "sqs://key:secret@"


def test_sqs_defaults_follow_kombus_30_minute_visibility_timeout() -> None:
    cfg = parse(broker=SQS, safe_time_redis_url=REDIS)
    assert (cfg.broker_kind, cfg.visibility_timeout, cfg.broker_consumer_timeout) == ("sqs", 1800, None)
    assert cfg.delay_threshold == 900
    assert "SQS DelaySeconds max 900 s" in cfg.delay_threshold_reason


def test_sqs_threshold_stays_within_delay_seconds() -> None:
    big = {"visibility_timeout": 43200}
    cfg = parse(broker=SQS, transport=big, safe_time_redis_url=REDIS, safe_time_delay_threshold=900)
    assert cfg.delay_threshold == 900
    with pytest.raises(ImproperlyConfigured, match=r"^safe_time_delay_threshold: .*DelaySeconds at most 900 s"):
        parse(broker=SQS, transport=big, safe_time_redis_url=REDIS, safe_time_delay_threshold=901)


def test_sqs_threshold_stays_below_the_visibility_timeout() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"visibility_timeout \(1800 s\)"):
        parse(broker=SQS, safe_time_redis_url=REDIS, safe_time_delay_threshold=1800)


@pytest.mark.parametrize("timeout", [43201, 86400, "100000"])
def test_sqs_visibility_timeout_above_12_hours_is_refused(timeout: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^broker_transport_options\.visibility_timeout: .*12 h"):
        parse(broker=SQS, transport={"visibility_timeout": timeout}, safe_time_redis_url=REDIS)
    # The 12 h limit is SQS's: Redis takes any visibility timeout.
    assert parse(transport={"visibility_timeout": timeout}).visibility_timeout == float(timeout)


def test_durations_accept_timedelta_and_numeric_strings() -> None:
    cfg = parse(safe_time_beat_lease=timedelta(seconds=12), safe_time_lock_ttl="90")
    assert cfg.beat_lease == 12
    assert cfg.lock_ttl == 90


def test_delay_retention_takes_seconds_or_a_timedelta() -> None:
    assert parse(safe_time_delay_retention=86400).delay_retention == 86400
    assert parse(safe_time_delay_retention=timedelta(days=7)).delay_retention == 7 * 86400
    assert parse(safe_time_delay_retention="3600").delay_retention == 3600
    assert parse(safe_time_delay_retention=None).delay_retention is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("3600", 3600), ("7d", 7 * 86400), ("12h", 43200), ("30m", 1800), ("45s", 45), ("2w", 14 * 86400), ("1.5h", 5400)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0d", "-1", "7x", "d", "seven days", "1e3"])
def test_parse_duration_rejects_nonsense_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_config_is_frozen() -> None:
    cfg = parse()
    with pytest.raises(AttributeError):
        cfg.beat_lease = 5  # type: ignore[misc]


def test_keys_are_prefixed() -> None:
    cfg = parse(safe_time_key_prefix="tenant-a:")
    assert cfg.key(C.KEY_BEAT_LEASE) == "tenant-a:beat:lease"
    assert cfg.key(C.KEY_LOCK, key="sync:1") == "tenant-a:lock:sync:1"


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"safe_time_beat_lease": 0}, "safe_time_beat_lease"),
        ({"safe_time_beat_lease": -5}, "safe_time_beat_lease"),
        ({"safe_time_beat_lease": "soon"}, "safe_time_beat_lease"),
        ({"safe_time_beat_lease": True}, "safe_time_beat_lease"),
        ({"safe_time_beat_lease": float("nan")}, "safe_time_beat_lease"),
        ({"safe_time_lock_ttl": 0}, "safe_time_lock_ttl"),
        ({"safe_time_lock_ttl": -1}, "safe_time_lock_ttl"),
        ({"safe_time_claim_timeout": 0}, "safe_time_claim_timeout"),
        ({"safe_time_sweep_interval": -1}, "safe_time_sweep_interval"),
        ({"safe_time_sweep_batch": 0}, "safe_time_sweep_batch"),
        ({"safe_time_sweep_batch": 2.5}, "safe_time_sweep_batch"),
        ({"safe_time_sweep_queue": ""}, "safe_time_sweep_queue"),
        ({"safe_time_misfire": "sometimes"}, "safe_time_misfire"),
        ({"safe_time_misfire_grace": 0}, "safe_time_misfire_grace"),
        ({"safe_time_delay_threshold": -1}, "safe_time_delay_threshold"),
        ({"safe_time_delay_threshold": 3600}, "safe_time_delay_threshold"),
        ({"safe_time_delay_threshold": 5000}, "safe_time_delay_threshold"),
        ({"safe_time_store_url": "mongodb://x/y"}, "safe_time_store_url"),
        ({"safe_time_store_url": ""}, "safe_time_store_url"),
        ({"safe_time_redis_url": "http://127.0.0.1:6379"}, "safe_time_redis_url"),
        ({"safe_time_redis_url": 6379}, "safe_time_redis_url"),
        ({"safe_time_key_prefix": ""}, "safe_time_key_prefix"),
        ({"safe_time_allow_pickle": "yes"}, "safe_time_allow_pickle"),
        ({"safe_time_max_clock_skew": -0.1}, "safe_time_max_clock_skew"),
        ({"safe_time_delay_retention": 0}, "safe_time_delay_retention"),
        ({"safe_time_delay_retention": -86400}, "safe_time_delay_retention"),
        ({"safe_time_delay_retention": "7d"}, "safe_time_delay_retention"),
        ({"safe_time_delay_retention": True}, "safe_time_delay_retention"),
        ({"safe_time_delay_retention": timedelta(0)}, "safe_time_delay_retention"),
        ({"safe_time_delay_retention": float("inf")}, "safe_time_delay_retention"),
    ],
)
def test_invalid_setting_names_the_key(settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        parse(**settings)
    assert info.value.key == key
    assert str(info.value).startswith(key + ":")
    assert isinstance(info.value, SafeTimeError)


def test_threshold_at_visibility_timeout_mentions_it() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"visibility_timeout \(600 s\)"):
        parse(transport={"visibility_timeout": 600}, safe_time_delay_threshold=600)


def test_invalid_visibility_timeout_is_named() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"broker_transport_options\.visibility_timeout"):
        parse(transport={"visibility_timeout": 0})


def test_redis_url_required_without_redis_broker() -> None:
    with pytest.raises(ImproperlyConfigured, match="safe_time_redis_url: is required"):
        parse(broker="amqp://guest@localhost//")


@pytest.mark.parametrize(
    "url", ["redis://h:1/0", "rediss://:pw@h:1/0", "unix:///tmp/redis.sock", "sentinel://h:26379/0?master=m"]
)
def test_redis_url_schemes(url: str) -> None:
    assert parse(safe_time_redis_url=url).redis_url == url


@pytest.mark.parametrize(
    "url", ["django", "sqlite:///x.db", "postgresql://u@h/db", "postgresql+psycopg://u@h/db", "mysql+pymysql://u@h/d"]
)
def test_store_url_schemes(url: str) -> None:
    assert parse(safe_time_store_url=url).store_url == url


def test_get_config_is_cached_per_app() -> None:
    app = Celery("a", broker=REDIS, set_as_current=False)
    first = get_config(app)
    assert get_config(app) is first
    other = Celery("b", broker=REDIS, set_as_current=False)
    other.conf.safe_time_beat_lease = 9
    assert get_config(other).beat_lease == 9
    assert get_config(app).beat_lease == 30
    reset_config(app)
    assert get_config(app) is not first


def test_app_with_invalid_setting_fails_naming_it() -> None:
    app = Celery("a", broker=REDIS, set_as_current=False)
    app.conf.safe_time_lock_ttl = -3
    with pytest.raises(ImproperlyConfigured, match="safe_time_lock_ttl"):
        get_config(app)


def test_django_style_namespace_settings() -> None:
    """``config_from_object(settings, namespace='CELERY')`` with CELERY_SAFE_TIME_* names."""

    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/3"
        CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 1000}
        CELERY_SAFE_TIME_BEAT_LEASE = 12
        CELERY_SAFE_TIME_KEY_PREFIX = "proj:"
        CELERY_SAFE_TIME_STORE_URL = "django"
        CELERY_SAFE_TIME_MISFIRE = "skip"
        SAFE_TIME_LOCK_TTL = 999  # not in the namespace: must be ignored

    app = Celery("proj", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    cfg = get_config(app)
    assert cfg.redis_url == "redis://127.0.0.1:6379/3"
    assert cfg.beat_lease == 12
    assert cfg.key_prefix == "proj:"
    assert cfg.store_url == "django"
    assert cfg.misfire == "skip"
    assert cfg.lock_ttl == 60
    assert cfg.delay_threshold == 500


def test_django_style_invalid_setting_is_named() -> None:
    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/3"
        CELERY_SAFE_TIME_MISFIRE = "never"

    app = Celery("proj", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ImproperlyConfigured, match="safe_time_misfire"):
        get_config(app)


def test_importing_the_package_loads_neither_the_django_orm_nor_sqlalchemy() -> None:
    """``task_cls='celery_safe_time:SafeTask'`` and Celery's entry-point scan import the package in
    every process; the ORM and SQLAlchemy load only when a store that needs them is used."""
    import subprocess
    import sys

    code = (
        "import sys, celery_safe_time\n"
        "celery_safe_time.SafeTask, celery_safe_time.SafeScheduler, celery_safe_time.overlap_lock\n"
        "import celery_safe_time.beat, celery_safe_time.delays, celery_safe_time.locks, celery_safe_time.cli\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'django_celery_beat')"
        " or m.startswith(('django.db', 'celery_safe_time.contrib'))]\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_app_on_rabbitmq_with_a_threshold_above_its_consumer_timeout_fails_at_startup() -> None:
    from celery_safe_time import install

    app = Celery("a", broker="amqp://guest:guest@127.0.0.1:5672//", set_as_current=False)
    app.conf.safe_time_redis_url = REDIS
    app.conf.safe_time_delay_threshold = 3600
    with pytest.raises(ImproperlyConfigured, match=r"safe_time_delay_threshold.*safe_time_broker_consumer_timeout"):
        install(app)
