"""``safe_time_coordination_url``: Redis by default, PostgreSQL by URL or "store", MySQL refused."""

from __future__ import annotations

from typing import Any

import pytest

from celery_safe_time import constants as C
from celery_safe_time.config import SafeTimeConfig, parse_config
from celery_safe_time.coordination import deadline_args, uses_postgres
from celery_safe_time.exceptions import ImproperlyConfigured

AMQP = "amqp://guest:guest@127.0.0.1:5672//"
PG = "postgresql://postgres@127.0.0.1:5432/test"


def parse(broker: str = AMQP, **settings: Any) -> SafeTimeConfig:
    return parse_config(settings.get, broker_url=broker)


def test_unset_is_redis_and_still_needs_a_redis_url_beside_rabbitmq() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"safe_time_redis_url.*safe_time_coordination_url"):
        parse()
    config = parse(safe_time_redis_url="redis://127.0.0.1:6379/1")
    assert config.coordination == C.COORDINATION_REDIS
    assert not uses_postgres(config)


def test_a_postgres_url_needs_no_redis() -> None:
    config = parse(safe_time_coordination_url=PG)
    assert uses_postgres(config)
    assert config.coordination_url == PG
    assert config.redis_url == ""


def test_store_means_the_stores_postgres_database() -> None:
    config = parse(safe_time_coordination_url="store", safe_time_store_url=PG)
    assert config.coordination_url == PG
    django = parse(safe_time_coordination_url="store", safe_time_store_url="django")
    assert django.coordination_url == "django"  # resolved from DATABASES when first connected


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"safe_time_coordination_url": "store"}, r"the store \(sqlite://\) is not PostgreSQL"),
        ({"safe_time_coordination_url": "mysql://root@127.0.0.1/test"}, "MySQL/MariaDB cannot coordinate"),
        ({"safe_time_coordination_url": "redis://127.0.0.1/0"}, "redis:// is not PostgreSQL"),
        ({"safe_time_coordination_url": 5}, "must be 'store' or a postgresql:// URL"),
    ],
)
def test_what_cannot_coordinate_fails_at_startup_naming_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="safe_time_coordination_url") as raised:
        parse(**settings)
    assert raised.match(message)


def test_coordination_connections_have_deadlines_by_default() -> None:
    config = parse(safe_time_coordination_url=PG)
    assert config.coordination_io_timeout == C.DEFAULT_COORDINATION_IO_TIMEOUT
    assert config.coordination_statement_timeout is None
    args = deadline_args(config)
    assert args["tcp_user_timeout"] == 10_000
    assert args["keepalives"] == 1
    assert args["keepalives_idle"] * 1 + args["keepalives_interval"] * args["keepalives_count"] <= 10
    assert "options" not in args  # statement_timeout is a startup option: off unless asked for


def test_a_statement_timeout_is_sent_as_a_startup_option() -> None:
    config = parse(
        safe_time_coordination_url=PG, safe_time_coordination_io_timeout=4, safe_time_coordination_statement_timeout=2.5
    )
    args = deadline_args(config)
    assert args["tcp_user_timeout"] == 4000
    assert args["options"] == "-c statement_timeout=2500"


@pytest.mark.parametrize("key", ["safe_time_coordination_io_timeout", "safe_time_coordination_statement_timeout"])
@pytest.mark.parametrize("value", [0, -1, "soon", float("inf")])
def test_a_bad_coordination_deadline_names_its_setting(key: str, value: object) -> None:
    with pytest.raises(ImproperlyConfigured, match=key):
        parse(safe_time_coordination_url=PG, **{key: value})
