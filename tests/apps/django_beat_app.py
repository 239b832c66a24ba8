"""The ``basic`` app inside the test Django project, for ``SafeDatabaseScheduler`` subprocesses.

``SAFE_TIME_TEST_DJANGO_DB_URL`` points Django at the test database of the pytest process.
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
django.setup()

from tests.apps.basic import app, record  # noqa: E402
from tests.apps.beat_app import overlap_run  # noqa: E402

__all__ = ["app", "overlap_run", "record"]
