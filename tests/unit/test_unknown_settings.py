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


def test_a_safe_time_key_outside_the_namespace_is_named_with_the_prefix_it_needs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 40, trap 2: Django's SAFE_TIME_STORE_URL beside namespace="CELERY" was ignored silently.
    class Settings:
        CELERY_BROKER_URL = REDIS
        SAFE_TIME_STORE_URL = "django"
        SAFE_TIME_CELERY_APP = "proj.celery:app"  # the admin's own setting: no namespace, read as is

    app = Celery("django-like", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        config = get_config(app)
    assert config.store_url != "django"
    assert [r.getMessage() for r in caplog.records] == [
        "setting 'SAFE_TIME_STORE_URL' is ignored: the app reads its settings with the 'CELERY_' prefix; "
        "name it 'CELERY_SAFE_TIME_STORE_URL'"
    ]


def test_a_django_project_is_told_its_delays_go_to_a_sqlite_file(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("django-project", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.conf.update(broker_url=REDIS)
    from django.conf import settings

    assert settings.configured
    assert app.conf.get("safe_time_store_url") is None  # tests/django_settings.py sets no store
    with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
        get_config(app)
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "CELERY_SAFE_TIME_STORE_URL is not set: stored delays go to sqlite:///celery_safe_time.sqlite3, a file in the "
        "current directory; set CELERY_SAFE_TIME_STORE_URL = 'django' to keep them in the project's database"
    ) in messages


def test_setting_warnings_are_not_logged_while_a_command_reports_them(caplog: pytest.LogCaptureFixture) -> None:
    from celery_safe_time.config import log_setting_warnings, setting_warnings

    app = _app(safe_time_beat_leese=12)
    log_setting_warnings(False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_safe_time.config"):
            get_config(app)
    finally:
        log_setting_warnings(True)
    assert caplog.records == []
    assert setting_warnings(app) == [
        "unknown setting 'safe_time_beat_leese' is ignored: did you mean 'safe_time_beat_lease'?"
    ]
