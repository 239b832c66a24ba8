"""Importable Celery apps for worker/beat subprocesses; settings come from environment variables."""
