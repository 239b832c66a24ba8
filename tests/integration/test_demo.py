"""The demo: the shortened scenario end to end (on Redis, on RabbitMQ, and on RabbitMQ with PostgreSQL
coordination and no Redis), the Redis it uses, and the admin pages it serves."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis

from demo_project.run import Demo, Timeline
from tests.helpers import services
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.integration


def _env(tmp_path: Path) -> dict[str, str]:
    # No DEMO_* from the caller's shell: DEMO_REDIS_URL would lend the demo a Redis of the machine.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DEMO_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["DEMO_VAR_DIR"] = str(tmp_path)
    return env


def _run_demo(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "demo_project.run", "--quick", *args],
        cwd=ROOT,
        env={**_env(tmp_path), **(env or {})},
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    assert "ALL EXPECTATIONS MET" in output
    assert "kill -9 leader" in output
    # The baseline really showed the problems, in the same run.
    assert "plain Celery, same run" in output
    return output


def _report_row(output: str, starts: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(starts)]
    assert len(lines) == 1, (starts, output[-4000:])
    return lines[0]


def test_quick_demo_meets_every_expectation_and_leaves_the_machines_redis_alone(
    tmp_path: Path, redis_db_url: str
) -> None:
    """The demo runs on a redis-server of its own: a key in the machine's Redis survives it."""
    machine = redis.Redis.from_url(redis_db_url)
    sentinel, value = f"not-the-demos:{uuid.uuid4().hex}", uuid.uuid4().hex
    machine.set(sentinel, value, ex=900)
    output = _run_demo(tmp_path)
    assert "FLUSHDB on the broker" in output
    assert "started a throwaway redis-server on 127.0.0.1:" in output
    port = str(redis.Redis.from_url(redis_db_url).connection_pool.connection_kwargs["port"])
    assert f"127.0.0.1:{port}/" not in output  # no URL of the machine's Redis anywhere in the run
    assert machine.get(sentinel) == value.encode()
    machine.delete(sentinel)


def test_quick_demo_on_rabbitmq_shows_the_consumer_timeout_crash_beside_safe_task(tmp_path: Path) -> None:
    """`make demo BROKER=amqp`: the same story on a RabbitMQ node of the demo's own (consumer_timeout
    20 s); plain Celery's worker holding a 50 s countdown is killed, SafeTask's stays up."""
    if not (shutil.which("rabbitmq-server") or os.access("/usr/lib/rabbitmq/bin/rabbitmq-server", os.X_OK)):
        services.unavailable("rabbitmq-server", "rabbitmq-server", "binary not found (the demo starts a node)")
    output = _run_demo(tmp_path, "--broker", "amqp")
    assert "started a throwaway RabbitMQ node on 127.0.0.1:" in output
    assert "purged the broker's queue" in output
    assert _report_row(output, "SafeTask worker stayed up (consumer_timeout 20s), every delay ran once").endswith("yes")
    killed = _report_row(output, "plain worker killed by consumer_timeout 20s")
    assert "yes (" in killed, killed
    assert "PRECONDITION_FAILED" in killed, killed
    assert "exited (PRECONDITION_FAILED); restarted" in output


def test_quick_demo_on_sqs_meets_every_expectation_and_shows_plain_duplicates(tmp_path: Path) -> None:
    """`make demo BROKER=sqs`: the same story on a local SQS-compatible endpoint the demo starts; the
    queue purge loses no stored delay, and plain Celery's countdowns past the 4 s visibility timeout
    run more than once each."""
    output = _run_demo(tmp_path, "--broker", "sqs")
    assert "started a local SQS-compatible endpoint (moto) on http://127.0.0.1:" in output
    assert "purged the broker's queue" in output
    row = _report_row(output, "countdown 10s > visibility_timeout 4s: runs per email")
    runs, emails = (int(n) for n in re.findall(r"(\d+) runs for (\d+) emails", row)[0])
    assert runs > emails, row


def test_quick_demo_on_postgres_and_rabbitmq_runs_with_no_redis_at_all(tmp_path: Path, redis_db_url: str) -> None:
    """`make demo COORD=postgres BROKER=amqp`: leases, fired slots, locks, idempotency markers and the
    store in a PostgreSQL database of the demo's own, RabbitMQ as the broker; the same expectations
    hold, no redis-server is started, nothing of the run connects to a Redis, and the database is
    dropped at the end."""
    if not (shutil.which("rabbitmq-server") or os.access("/usr/lib/rabbitmq/bin/rabbitmq-server", os.X_OK)):
        services.unavailable("rabbitmq-server", "rabbitmq-server", "binary not found (the demo starts a node)")
    admin = urlsplit(services.resolve_postgres_admin_url())
    admin_url = urlunsplit(("postgresql", admin.netloc, "/postgres", "", ""))  # never the test database
    machine = redis.Redis.from_url(redis_db_url)
    sentinel, value = f"not-the-demos:{uuid.uuid4().hex}", uuid.uuid4().hex
    machine.set(sentinel, value, ex=900)
    output = _run_demo(tmp_path, "--broker", "amqp", "--coord", "postgres", env={"DEMO_POSTGRES_URL": admin_url})
    assert "started a throwaway redis-server" not in output
    assert "no Redis in this run: safe_time_redis_url unset, no redis-server started" in output
    assert "redis processes none, connections to :6379 none" in output
    assert _report_row(output, "no Redis process ran").endswith("none        yes")
    for row in ("  slots published twice", "  overlapping syncs of one account", "  duplicate invoices"):
        assert _report_row(output, row).endswith("yes"), row
    assert "visibility_timeout" not in output.split("plain Celery, same run")[1]  # a Redis-only row
    assert _report_row(output, "SafeTask worker stayed up (consumer_timeout 20s), every delay ran once").endswith("yes")
    name = re.search(r"created a throwaway PostgreSQL database (safe_time_demo_\w+) ", output)
    assert name, output[:2000]
    assert f"locks/leases PostgreSQL database {name[1]}" in output
    with psycopg.connect(admin_url, autocommit=True) as conn:
        left = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name[1],)).fetchall()
    assert left == [], f"the demo left its database {name[1]} behind"
    assert machine.get(sentinel) == value.encode()
    machine.delete(sentinel)


def _demo_on(url: str, tmp_path: Path) -> Demo:
    args = argparse.Namespace(quick=True, serve=False, broker="redis")
    return Demo(args, Timeline.quick(), tmp_path, url)


def test_a_lent_redis_gives_only_empty_databases_and_keeps_every_other_key(
    redis_server: services.RedisServer, tmp_path: Path
) -> None:
    """DEMO_REDIS_URL: the demo claims three empty databases (15, 14, 13 here: 1-12 hold a key each)
    and empties only those when it is done."""
    for db in range(1, 13):
        redis.Redis.from_url(services.with_db(redis_server.url, db)).set("theirs", db)
    demo = _demo_on(redis_server.url, tmp_path)
    demo.claim_redis()
    assert sorted(demo.dbs) == [13, 14, 15]
    for db in demo.dbs:
        redis.Redis.from_url(demo.url(db)).set("the-demos", 1)
    demo.release()
    for db in range(1, 13):
        assert redis.Redis.from_url(services.with_db(redis_server.url, db)).get("theirs") == str(db).encode()
    for db in (13, 14, 15):
        assert redis.Redis.from_url(services.with_db(redis_server.url, db)).dbsize() == 0
    assert redis.Redis.from_url(redis_server.url).keys("safe_time_test:db:*") == []


def test_a_lent_redis_without_three_empty_databases_is_refused_untouched(
    redis_server: services.RedisServer, tmp_path: Path
) -> None:
    for db in range(1, 14):
        redis.Redis.from_url(services.with_db(redis_server.url, db)).set("theirs", db)
    demo = _demo_on(redis_server.url, tmp_path)
    with pytest.raises(SystemExit, match=r"needs three empty databases among 1-15 and found 2 .*never empties"):
        demo.claim_redis()
    for db in range(1, 14):
        assert redis.Redis.from_url(services.with_db(redis_server.url, db)).get("theirs") == str(db).encode()
    assert redis.Redis.from_url(redis_server.url).keys("safe_time_test:db:*") == []


def test_demo_redis_url_that_does_not_answer_names_the_variable(tmp_path: Path) -> None:
    env = _env(tmp_path)
    env["DEMO_REDIS_URL"] = f"redis://127.0.0.1:{services.free_port()}/0"
    result = subprocess.run(
        [sys.executable, "-m", "demo_project.run", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "DEMO_REDIS_URL=redis://127.0.0.1:" in result.stderr
    assert "did not answer PING" in result.stderr


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


@pytest.mark.parametrize(
    "deployment",
    [
        {},
        # The PostgreSQL deployment's settings (coordination in the store's database, RabbitMQ): the
        # plugin replaces them for each test as it does the Redis ones.
        {"DEMO_COORDINATION_URL": "store", "DEMO_BROKER_URL": "amqp://guest:guest@127.0.0.1:1//"},
    ],
    ids=["redis-settings", "postgres-coordination-settings"],
)
def test_demo_projects_own_tests_pass_with_the_plugin_and_no_redis(tmp_path: Path, deployment: dict[str, str]) -> None:
    """demo_project/tests use celery_safe_time.testing: with Redis pointed at a closed port they still pass."""
    env = _env(tmp_path)
    env["DEMO_REDIS_URL"] = "redis://127.0.0.1:1/0"  # nothing listens there: no test may need Redis
    env.update(deployment)
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
