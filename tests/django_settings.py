"""Django settings for the test suite (pytest-django and Django-based subprocess apps).

The database is PostgreSQL from ``SAFE_TIME_TEST_DJANGO_DB_URL`` when set (the subprocess
apps get the test database's URL this way), else the local server's ``test`` database, whose
pytest-django copy is named per process so concurrent runs never collide.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

SECRET_KEY = "celery-safe-time-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.django_urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "celery_safe_time.contrib.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def _database() -> dict[str, object]:
    url = os.environ.get("SAFE_TIME_TEST_DJANGO_DB_URL") or os.environ.get(
        "SAFE_TIME_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
    )
    parts = urlsplit(url.replace("postgresql+psycopg://", "postgresql://"))
    name = parts.path.lstrip("/") or "test"
    db: dict[str, object] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
        "CONN_MAX_AGE": 0,
    }
    if not os.environ.get("SAFE_TIME_TEST_DJANGO_DB_URL"):
        db["TEST"] = {"NAME": f"test_safe_time_dj_{os.getpid()}"}
    return db


DATABASES = {"default": _database()}
