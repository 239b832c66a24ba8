"""Test helpers: real services, Celery apps and real worker/beat subprocesses."""
