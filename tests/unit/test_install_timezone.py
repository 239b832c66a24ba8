"""``install()`` validates the app's ``timezone`` (issue 21, item 9): a typo fails there, naming the setting."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_safe_time import install
from celery_safe_time.exceptions import ImproperlyConfigured


def _app(**conf: object) -> Celery:
    app = Celery("tz", set_as_current=False)
    app.conf.update(broker_url="redis://127.0.0.1:6379/0", safe_time_store_url="sqlite://", **conf)
    return app


def test_unknown_timezone_fails_in_install_naming_the_setting_and_the_closest_zone() -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        install(_app(timezone="Europe/Lodnon"))
    assert info.value.key == "timezone"
    assert str(info.value) == "timezone: 'Europe/Lodnon' is not a known time zone: did you mean 'Europe/London'?"


def test_djangos_time_zone_fallback_is_checked_too() -> None:
    class Settings:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/0"
        CELERY_SAFE_TIME_STORE_URL = "sqlite://"
        TIME_ZONE = "America/Nwe_York"

    app = Celery("tz-django", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ImproperlyConfigured, match=r"^timezone: 'America/Nwe_York' .*'America/New_York'"):
        install(app)


@pytest.mark.parametrize("value", ["", "not a zone at all ../../etc/passwd", 42])
def test_nonsense_is_refused_with_an_example(value: object) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^timezone: "):
        install(_app(timezone=value))


@pytest.mark.parametrize("value", [None, "UTC", "Europe/London", "Asia/Kolkata"])
def test_valid_or_unset_timezone_installs(value: str | None) -> None:
    config = install(_app(timezone=value))
    assert config.store_url == "sqlite://"
