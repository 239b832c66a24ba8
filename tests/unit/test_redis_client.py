from __future__ import annotations

import pytest

from celery_safe_time.exceptions import ImproperlyConfigured
from celery_safe_time.redis_client import create_redis, mask_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:secret@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:p%40ss@h/1", "rediss://user:***@h/1"),
        ("redis://h:6379", "redis://h:6379"),
        ("postgresql://app:hunter2@db/prod", "postgresql://app:***@db/prod"),
        ("sentinel://:pw@a:1,b:2/0?master=m", "sentinel://:***@a:1,b:2/0?master=m"),
        ("", ""),
        ("redis://h:6379/0?password=hunter2", "redis://h:6379/0?password=***"),
        (
            "postgresql://app@db/prod?sslmode=require&password=s3&x=1",
            "postgresql://app@db/prod?sslmode=require&password=***&x=1",
        ),
        (
            "sentinel://a:1/0?master=m&sentinel_password=pw&PASSWORD=p2",
            "sentinel://a:1/0?master=m&sentinel_password=***&PASSWORD=***",
        ),
        ("redis://:pw@h/0?password=pw2", "redis://:***@h/0?password=***"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_client_has_timeouts() -> None:
    client = create_redis("redis://127.0.0.1:6379/0")
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 5
    assert kwargs["socket_connect_timeout"] == 5


def test_tls_url_uses_ssl_connection() -> None:
    client = create_redis("rediss://:pw@127.0.0.1:6380/0")
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert client.connection_pool.connection_kwargs["password"] == "pw"


def test_sentinel_needs_master_name() -> None:
    with pytest.raises(ImproperlyConfigured, match="master"):
        create_redis("sentinel://127.0.0.1:26379/0")
