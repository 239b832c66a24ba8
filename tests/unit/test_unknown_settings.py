"""A misspelt ``safe_time_*`` setting is warned about at startup, naming the closest known key (issue 21)."""

from __future__ import annotations

import logging

import pytest
from celery import Celery

from celery_safe_time.config import get_config, known_setting_names, unknown_setting_warnings
from celery_safe_time.exceptions import ImproperlyConfigured

REDIS = "redis://127.0.0.1:6379/0"


def _app(**conf: object) -> Celery:
    app = Celery("unknown-settings", set_as_current=False)
    app.conf.update(broker_url=REDIS, **conf)
    return app


def test_misspelt_setting_names_the_closest_known_key(caplog: pytest.LogCaptureFixture) -> None:
    app = _app(safe_time_beat_leese=12, safe_time_beat_lease=30)
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        get_config(app)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["unknown setting 'safe_time_beat_leese' is ignored: did you mean 'safe_time_beat_lease'?"]
    assert caplog.records[0].levelno == logging.WARNING


def test_warned_once_per_app_not_on_every_lookup(caplog: pytest.LogCaptureFixture) -> None:
    app = _app(safe_time_redis_ulr="redis://127.0.0.1:6379/1")
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        get_config(app)
        get_config(app)
    assert len(caplog.records) == 1
    assert "'safe_time_redis_url'" in caplog.records[0].getMessage()


def test_django_namespace_keys_are_checked_too(caplog: pytest.LogCaptureFixture) -> None:
    class Settings:
        CELERY_BROKER_URL = REDIS
        CELERY_SAFE_TIME_SWEEP_INTERVALL = 10
        CELERY_SAFE_TIME_LOCK_TTL = 30

    app = Celery("django-like", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        config = get_config(app)
    assert config.lock_ttl == 30
    assert [r.getMessage() for r in caplog.records] == [
        "unknown setting 'safe_time_sweep_intervall' is ignored: did you mean 'safe_time_sweep_interval'?"
    ]


def test_known_and_foreign_settings_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    app = _app(
        safe_time_beat_lease=30,
        safe_time_misfire="skip",
        safe_time_delay_threshold=60,
        safe_time_broker_consumer_timeout=1800,
        task_acks_late=True,
        beat_max_loop_interval=5,
    )
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        get_config(app)
    assert caplog.records == []


def test_nothing_close_lists_the_known_keys() -> None:
    [message] = unknown_setting_warnings(["safe_time_zzz"], ["safe_time_lock_ttl", "safe_time_beat_lease"])
    assert message == (
        "unknown setting 'safe_time_zzz' is ignored: known settings: safe_time_beat_lease, safe_time_lock_ttl"
    )


def test_the_admins_django_setting_is_known(caplog: pytest.LogCaptureFixture) -> None:
    # Django settings loaded without a namespace put SAFE_TIME_CELERY_APP on app.conf too.
    class Settings:
        BROKER_URL = REDIS
        SAFE_TIME_CELERY_APP = "project.celery:app"

    app = Celery("django-no-namespace", set_as_current=False)
    app.config_from_object(Settings)
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        get_config(app)
    assert caplog.records == []


def test_the_error_about_a_missing_setting_names_the_misspelt_key_the_app_set() -> None:
    app = Celery("near-miss", set_as_current=False)
    app.conf.update(broker_url="amqp://guest:guest@127.0.0.1//", safe_time_redis_ulr=REDIS)
    with pytest.raises(ImproperlyConfigured) as caught:
        get_config(app)
    assert caught.value.key == "safe_time_redis_url"
    assert str(caught.value).endswith(
        "; the app sets 'safe_time_redis_ulr', which is ignored: did you mean 'safe_time_redis_url'?"
    )


def test_every_setting_parse_config_reads_is_known() -> None:
    assert {"safe_time_redis_url", "safe_time_coordination_url", "safe_time_celery_app"} <= known_setting_names()
