"""``celery -A app safe-time check`` against the real Redis and store databases."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_safe_time.checks import run_checks, worst
from celery_safe_time.clock import RedisClock, local_time, measure_redis_offset
from celery_safe_time.config import get_config
from celery_safe_time.delays.backends import get_store
from celery_safe_time.health import check_redis
from tests.helpers.processes import ProcessManager
from tests.helpers.services import RedisServer, free_port

pytestmark = pytest.mark.integration

APP = "tests.apps.checkapp"


def run_check(
    processes: ProcessManager,
    *args: str,
    conf: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
    own_process: bool = False,
):  # type: ignore[no-untyped-def]
    """``safe-time check`` in the test process, or in a process of its own (``own_process``) where the
    environment must be there at the package's import."""
    env = dict(env or {})
    if conf is not None:
        env["SAFE_TIME_TEST_APP_CONF"] = json.dumps(conf)
    run = processes.command if own_process else processes.cli
    return run(APP, "safe-time", "check", *args, env=env)


def test_check_passes_against_real_services(processes: ProcessManager) -> None:
    result = run_check(processes, conf={"safe_time_max_clock_skew": 1.0})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clock_skew_redis" in result.stdout
    assert "clock_skew_store" in result.stdout
    assert "maxmemory-policy" in result.stdout
    assert "overall:" in result.stdout


def test_check_json_with_postgres_store(processes: ProcessManager, postgres_url: str) -> None:
    result = run_check(processes, "--json", conf={"safe_time_max_clock_skew": 1.0, "safe_time_store_url": postgres_url})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["status"] in ("ok", "warn")
    assert by_name["store"]["status"] == "ok"
    assert abs(by_name["clock_skew_store"]["value"]) < 1.0
    assert abs(by_name["clock_skew_redis"]["value"]) < 1.0
    # The machine's Redis keeps nothing on disk: the check must say so.
    assert by_name["redis_persistence"]["status"] in ("ok", "warn")


def test_check_fails_when_skew_limit_is_zero(processes: ProcessManager) -> None:
    result = run_check(processes, conf={"safe_time_max_clock_skew": 0})
    assert result.returncode == 1
    assert "FAIL" in result.stdout
    assert "clock_skew_redis" in result.stdout


def test_check_fails_with_injected_local_skew(processes: ProcessManager) -> None:
    result = run_check(
        processes,
        "--json",
        conf={"safe_time_max_clock_skew": 1.0},
        env={"SAFE_TIME_LOCAL_CLOCK_SKEW": "30"},  # read once, at celery_safe_time.clock's import
        own_process=True,
    )
    assert result.returncode == 1
    by_name = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    # A host 30 s fast sees both authorities 30 s behind it (within the round trip).
    assert by_name["clock_skew_redis"]["status"] == "fail"
    assert by_name["clock_skew_redis"]["value"] == pytest.approx(-30, abs=1)
    assert by_name["clock_skew_store"]["status"] == "fail"
    assert by_name["clock_skew_store"]["value"] == pytest.approx(-30, abs=1)


def test_check_fails_when_redis_is_stopped(processes: ProcessManager, redis_server: RedisServer) -> None:
    url = redis_server.url
    redis_server.stop()
    result = run_check(processes, "--json", conf={"safe_time_redis_url": url.replace("redis://", "redis://:s3cret@")})
    assert result.returncode == 1
    report = json.loads(result.stdout)
    redis_check = next(c for c in report["checks"] if c["name"] == "redis")
    assert redis_check["status"] == "fail"
    assert "unreachable" in redis_check["detail"]
    assert "s3cret" not in result.stdout + result.stderr


def test_check_fails_when_store_database_is_missing(processes: ProcessManager, postgres_url: str) -> None:
    missing = postgres_url.rsplit("/", 1)[0] + "/no_such_database_here"
    result = run_check(processes, conf={"safe_time_store_url": missing, "safe_time_max_clock_skew": 1.0})
    assert result.returncode == 1
    assert "store" in result.stdout
    assert "unreachable" in result.stdout


def test_check_reports_invalid_settings(processes: ProcessManager) -> None:
    result = run_check(processes, conf={"safe_time_misfire": "whenever"})
    assert result.returncode == 1
    assert "safe_time_misfire" in result.stdout


def test_persistence_and_eviction_warnings(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    app = Celery("t", broker=redis_server.url, set_as_current=False)
    checks = {c.name: c for c in check_redis(get_config(app), client)}
    assert checks["redis_persistence"].status == "warn"
    assert checks["redis_eviction"].status == "warn"
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("appendonly", "yes")
    checks = {c.name: c for c in check_redis(get_config(app), client)}
    assert checks["redis_persistence"].status == "ok"
    assert checks["redis_eviction"].status == "ok"


def test_redis_clock_tracks_redis_time(redis_client: redis.Redis) -> None:
    clock = RedisClock(redis_client, refresh=60)
    seconds, micros = redis_client.time()
    assert abs(clock.time() - (seconds + micros / 1e6)) < 0.5
    offset = measure_redis_offset(redis_client)
    assert offset.rtt < 1.0
    assert abs(offset.offset) < 1.0


def test_redis_clock_corrects_a_skewed_local_clock(redis_client: redis.Redis) -> None:
    def skewed() -> float:
        return local_time() + 300.0

    clock = RedisClock(redis_client, local=skewed)
    seconds, micros = redis_client.time()
    assert abs(clock.time() - (seconds + micros / 1e6)) < 0.5


def test_run_checks_in_process_uses_real_store(make_app, postgres_url: str) -> None:  # type: ignore[no-untyped-def]
    app = make_app(safe_time_store_url=postgres_url, safe_time_max_clock_skew=5)
    checks = run_checks(app)
    assert worst(checks) in ("ok", "warn"), checks
    assert get_store(app).now().tzinfo is not None


def test_check_on_rabbitmq_reports_the_broker_its_consumer_timeout_and_the_threshold(
    processes: ProcessManager, amqp_url: str, redis_url: str
) -> None:
    env = {"SAFE_TIME_TEST_BROKER_URL": amqp_url}
    conf = {"safe_time_max_clock_skew": 1.0, "safe_time_redis_url": redis_url, "result_backend": redis_url}
    result = run_check(processes, conf=conf, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.split()[1:2] == ["broker"])
    assert "amqp: RabbitMQ" in line
    assert "consumer_timeout 1800 s" in line
    assert "delay threshold 900 s (default: min(900, safe_time_broker_consumer_timeout 1800 s / 2))" in line

    report = json.loads(run_check(processes, "--json", conf=conf, env=env).stdout)
    broker = next(c for c in report["checks"] if c["name"] == "broker")
    assert broker["value"]["kind"] == "amqp"
    assert broker["value"]["delay_threshold"] == 900


def test_check_on_rabbitmq_refuses_a_threshold_at_the_consumer_timeout(
    processes: ProcessManager, amqp_url: str, redis_url: str
) -> None:
    conf = {"safe_time_redis_url": redis_url, "result_backend": redis_url, "safe_time_delay_threshold": 1800}
    result = run_check(processes, conf=conf, env={"SAFE_TIME_TEST_BROKER_URL": amqp_url})
    assert result.returncode == 1
    assert "safe_time_delay_threshold" in result.stdout
    assert "safe_time_broker_consumer_timeout (1800 s)" in result.stdout


def _broker_row(stdout: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.split()[1:2] == ["broker"])


@pytest.mark.parametrize("scheme", ["amqp", "redis"])
def test_check_fails_the_broker_row_when_nothing_listens_at_the_broker_url(
    processes: ProcessManager, redis_url: str, scheme: str
) -> None:
    port = free_port()
    closed = f"{scheme}://guest:s3cret@127.0.0.1:{port}/{'/' if scheme == 'amqp' else '0'}"
    conf = {"safe_time_redis_url": redis_url, "result_backend": redis_url}
    result = run_check(processes, conf=conf, env={"SAFE_TIME_TEST_BROKER_URL": closed})
    assert result.returncode == 1, result.stdout + result.stderr
    row = _broker_row(result.stdout)
    assert row.startswith("FAIL"), row
    assert f"{scheme}://guest:***@127.0.0.1:{port}/" in row, row
    assert " unreachable: " in row, row
    assert "s3cret" not in result.stdout + result.stderr


def test_check_fails_the_broker_row_on_a_wrong_rabbitmq_password(
    processes: ProcessManager, amqp_url: str, redis_url: str
) -> None:
    wrong = amqp_url.replace("guest:guest@", "guest:not-the-password@")
    conf = {"safe_time_redis_url": redis_url, "result_backend": redis_url}
    result = run_check(processes, conf=conf, env={"SAFE_TIME_TEST_BROKER_URL": wrong})
    assert result.returncode == 1, result.stdout + result.stderr
    row = _broker_row(result.stdout)
    assert row.startswith("FAIL"), row
    assert "unreachable: AccessRefused" in row, row
    assert "not-the-password" not in result.stdout + result.stderr


def test_check_says_the_broker_answered(processes: ProcessManager, amqp_url: str, redis_url: str) -> None:
    conf = {"safe_time_redis_url": redis_url, "result_backend": redis_url, "safe_time_max_clock_skew": 1.0}
    result = run_check(processes, conf=conf, env={"SAFE_TIME_TEST_BROKER_URL": amqp_url})
    assert result.returncode == 0, result.stdout + result.stderr
    row = _broker_row(result.stdout)
    assert row.startswith("OK"), row
    assert "guest:***@127.0.0.1:5672" in row, row
    assert " reachable (connected in " in row, row


def test_check_shows_a_database_error_on_one_line_without_sqlalchemys_notes(
    processes: ProcessManager, postgres_url: str
) -> None:
    missing = postgres_url.rsplit("/", 1)[0] + "/no_such_database_here"
    result = run_check(processes, conf={"safe_time_store_url": missing, "safe_time_max_clock_skew": 1.0})
    assert result.returncode == 1
    assert "Background on this error" not in result.stdout + result.stderr
    [row] = [line for line in result.stdout.splitlines() if line.split()[1:2] == ["store"]]
    assert row.startswith("FAIL  store "), row
    assert row.count("unreachable") == 1, row
    assert row.endswith('database "no_such_database_here" does not exist'), row
