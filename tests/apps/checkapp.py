"""App for ``celery safe-time check`` tests (settings from the environment)."""

from __future__ import annotations

from celery import Celery

from tests.apps.settings import configure

app = configure(Celery("checkapp"))
