"""Settings of the demo SaaS: tenants with trials, invoices and inventory syncs.

Celery and celery-safe-time are configured the way a Django team would: ``CELERY_*`` names
read with ``config_from_object(..., namespace="CELERY")``. ``demo_project.run`` overrides a
few values through the environment to compress "14 days" into seconds.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent
VAR_DIR = Path(os.environ.get("DEMO_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DEMO_SECRET_KEY", "demo-only-not-secret")
DEBUG = bool(os.environ.get("DEMO_DEBUG"))
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "demo_project.urls"
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
    "demo_project.tenants",
    "demo_project.billing",
    "demo_project.trials",
    "demo_project.inventory",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
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
    url = os.environ.get("DATABASE_URL")
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "demo.sqlite3"),
            # Several worker and beat processes write; wait for the lock instead of failing.
            "OPTIONS": {"timeout": 30},
        }
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


DATABASES = {"default": _database()}

# --- Celery --------------------------------------------------------------------------
REDIS_URL = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = os.environ.get("DEMO_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": float(os.environ.get("DEMO_VISIBILITY_TIMEOUT", 3600)),
    # The same aggressive unacked sweep as the plain side of the demo, so the comparison is fair.
    "unacked_restore_interval": int(os.environ.get("DEMO_RESTORE_INTERVAL", 10)),
    "unacked_restore_throttle": int(os.environ.get("DEMO_RESTORE_THROTTLE", 10)),
}
if os.environ.get("DEMO_SQS_QUEUE_PREFIX"):  # `make demo BROKER=sqs`: the demo's local SQS endpoint
    CELERY_BROKER_TRANSPORT_OPTIONS.update(
        region="us-east-1",
        is_secure=False,
        queue_name_prefix=os.environ["DEMO_SQS_QUEUE_PREFIX"],
        wait_time_seconds=1,
        polling_interval=0.2,
    )

# --- celery-safe-time ----------------------------------------------------------------
if os.environ.get("DEMO_COORDINATION_URL"):
    # `make demo COORD=postgres`: leases, fired slots, locks and idempotency markers in PostgreSQL
    # ("store": the Django database); no safe_time_redis_url, so nothing of the package talks to Redis.
    CELERY_SAFE_TIME_COORDINATION_URL = os.environ["DEMO_COORDINATION_URL"]
else:
    CELERY_SAFE_TIME_REDIS_URL = REDIS_URL
CELERY_SAFE_TIME_KEY_PREFIX = os.environ.get("DEMO_KEY_PREFIX", "demo:")
CELERY_SAFE_TIME_STORE_URL = "django"
CELERY_SAFE_TIME_BEAT_LEASE = float(os.environ.get("DEMO_BEAT_LEASE", 30))
CELERY_SAFE_TIME_DELAY_THRESHOLD = float(os.environ.get("DEMO_DELAY_THRESHOLD", 900))
CELERY_SAFE_TIME_SWEEP_INTERVAL = float(os.environ.get("DEMO_SWEEP_INTERVAL", 5))
CELERY_SAFE_TIME_LOCK_TTL = float(os.environ.get("DEMO_LOCK_TTL", 60))
# The app the admin's "Safe time" page reads (the web process never imports it otherwise).
SAFE_TIME_CELERY_APP = "demo_project.celery_app:app"
if os.environ.get("DEMO_CONSUMER_TIMEOUT"):  # `make demo BROKER=amqp`: the demo node's consumer_timeout
    CELERY_SAFE_TIME_BROKER_CONSUMER_TIMEOUT = float(os.environ["DEMO_CONSUMER_TIMEOUT"])

# --- the product's own knobs ---------------------------------------------------------
TRIAL_LENGTH = timedelta(seconds=float(os.environ.get("DEMO_TRIAL_SECONDS", 14 * 86400)))
SYNC_SECONDS = float(os.environ.get("DEMO_SYNC_SECONDS", 8 * 60))
SYNC_EVERY = float(os.environ.get("DEMO_SYNC_EVERY", 5 * 60))
INVOICE_EVERY = os.environ.get("DEMO_INVOICE_EVERY")  # seconds; unset = monthly crontab
