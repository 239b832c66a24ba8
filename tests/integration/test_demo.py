"""The demo: the shortened scenario end to end, and the admin pages it serves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.processes import ROOT

pytestmark = pytest.mark.integration


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env["PYTHONPATH"] = str(ROOT)
    env["DEMO_VAR_DIR"] = str(tmp_path)
    return env


def test_quick_demo_meets_every_expectation(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "demo_project.run", "--quick"],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    assert "ALL EXPECTATIONS MET" in output
    assert "kill -9 leader" in output
    assert "FLUSHDB on the broker" in output
    # The baseline really showed the problems, in the same run.
    assert "plain Celery, same run" in output


ADMIN_SCRIPT = textwrap.dedent(
    """
    import os, django
    os.environ["DJANGO_SETTINGS_MODULE"] = "demo_project.settings"
    django.setup()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.test.utils import setup_test_environment
    setup_test_environment()
    from demo_project.celery_app import app
    from demo_project.tenants.models import Tenant
    from demo_project.trials.tasks import start_trial
    from celery_safe_time.contrib.django.models import DelayedTask
    tenant = Tenant.objects.create(name="acme", timezone="Europe/Berlin")
    task_id = start_trial(tenant)
    assert DelayedTask.objects.filter(pk=task_id, status="pending").exists()
    get_user_model().objects.create_superuser("admin", "a@example.com", "pw")
    client = Client()
    assert client.login(username="admin", password="pw")
    for url in [
        "/admin/celery_safe_time/delayedtask/",
        "/admin/celery_safe_time/delayedtask/?status__exact=pending",
        f"/admin/celery_safe_time/delayedtask/{task_id}/change/",
        "/admin/django_celery_beat/periodictask/",
        "/admin/demo_tenants/tenant/",
        "/admin/demo_tenants/email/",
        "/admin/demo_inventory/syncrun/",
    ]:
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code)
    body = client.get("/admin/celery_safe_time/delayedtask/").content.decode()
    assert task_id in body, "stored delay not listed"
    print("ADMIN OK")
    """
)


def test_demo_admin_changelists_render(tmp_path: Path, redis_db_url: str) -> None:
    env = _env(tmp_path)
    env["DEMO_REDIS_URL"] = redis_db_url
    env["DEMO_BROKER_URL"] = redis_db_url
    env["DEMO_TRIAL_SECONDS"] = str(14 * 86400)
    result = subprocess.run(
        [sys.executable, "-c", ADMIN_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ADMIN OK" in result.stdout


def test_demo_projects_own_tests_pass_with_the_plugin_and_no_redis(tmp_path: Path) -> None:
    """demo_project/tests use celery_safe_time.testing: with Redis pointed at a closed port they still pass."""
    env = _env(tmp_path)
    env["DEMO_REDIS_URL"] = "redis://127.0.0.1:1/0"  # nothing listens there: no test may need Redis
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "demo_project/tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "7 passed" in output, output[-3000:]
