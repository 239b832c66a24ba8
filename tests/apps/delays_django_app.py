"""The durable-delay test app on the Django ORM store (``safe_time_store_url = "django"``).

The test passes its pytest-django database as ``SAFE_TIME_TEST_DJANGO_DB_URL``.
"""

from __future__ import annotations

import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
django.setup()

from celery_safe_time import install  # noqa: E402 - after django.setup()
from tests.apps.delays_tasks import define_tasks  # noqa: E402
from tests.apps.settings import configure  # noqa: E402

app = configure(Celery("delays_django_app"), safe_time_store_url="django")
app.conf.safe_time_store_url = "django"
install(app)
tasks = define_tasks(app)
