"""``rediss://`` and ``rediss+cluster://`` against a TLS-only redis-server and cluster, with a CA and
certificates this module makes (openssl).

The server certificate names ``localhost`` only (no IP address), so the same server serves the good
case (``rediss://localhost``), the hostname mismatch (``rediss://127.0.0.1``) and the unknown CA
(another CA in ``ssl_ca_certs``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_safe_time.beat.backends.redis import Lease
from celery_safe_time.beat.base import startup_checks
from celery_safe_time.clock import RedisClock
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import ImproperlyConfigured
from celery_safe_time.health import check_redis
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.backends.redis import RedisLockBackend
from celery_safe_time.redis_client import create_redis, is_cluster
from tests.helpers.beat import BEAT_APP, beat_env, runs
from tests.helpers.processes import ProcessManager, wait_for
from tests.helpers.topologies import LocalCluster, Node, TlsFiles, start_tls_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return TlsFiles(tmp_path_factory.mktemp("tls")).make(names="DNS:localhost")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, tls: TlsFiles) -> Iterator[Node]:
    # start_tls_redis pings through 127.0.0.1 with its own client: that one must not check names.
    node = start_tls_redis(tmp_path_factory.mktemp("tls-redis"), tls, check_hostname=False)
    yield node
    node.stop()


def _url(node: Node, ca: Path, host: str = "localhost", extra: str = "") -> str:
    return f"rediss://{host}:{node.port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required{extra}"


def _startup(app: Celery) -> None:
    config = get_config(app)
    client = create_redis(config.redis_url)
    startup_checks(config, client, RedisClock(client), "beat")


def test_rediss_with_the_ca_runs_leases_and_locks(
    make_app: Callable[..., Celery], tls_server: Node, tls: TlsFiles
) -> None:
    app = make_app(safe_time_redis_url=_url(tls_server, tls.ca))
    _startup(app)
    config = get_config(app)
    client = create_redis(config.redis_url)
    assert Lease(client, config).acquire(0.0) == 1
    owner = Owner(task_id="t", identity="t:0:0", host="h", pid=1)
    assert RedisLockBackend(client, config).acquire("k", "tok", 5, owner).status == "acquired"
    assert {c.name: c.status for c in check_redis(config, client)}["redis"] == "ok"


def test_an_unknown_ca_fails_at_startup_naming_the_setting(
    make_app: Callable[..., Celery], tls_server: Node, tls: TlsFiles
) -> None:
    app = make_app(safe_time_redis_url=_url(tls_server, tls.other_ca))
    with pytest.raises(ImproperlyConfigured, match=r"safe_time_redis_url: beat: TLS handshake.*ssl_ca_certs") as exc:
        _startup(app)
    assert exc.value.key == "safe_time_redis_url"
    checks = {c.name: c for c in check_redis(get_config(app))}
    assert checks["redis"].status == "fail"
    assert "safe_time_redis_url" in checks["redis"].detail
    assert "ssl_ca_certs" in checks["redis"].detail


def test_a_hostname_mismatch_fails_at_startup_naming_the_setting(
    make_app: Callable[..., Celery], tls_server: Node, tls: TlsFiles
) -> None:
    app = make_app(safe_time_redis_url=_url(tls_server, tls.ca, host="127.0.0.1"))
    with pytest.raises(
        ImproperlyConfigured, match=r"safe_time_redis_url: .*does not name this host.*ssl_check_hostname"
    ):
        _startup(app)
    # The documented opt-out: the CA is still checked, the name is not.
    relaxed = make_app(
        safe_time_redis_url=_url(tls_server, tls.ca, host="127.0.0.1", extra="&ssl_check_hostname=false")
    )
    _startup(relaxed)


def test_a_plain_client_against_the_tls_port_is_an_error_not_a_hang(
    make_app: Callable[..., Celery], tls_server: Node
) -> None:
    app = make_app(safe_time_redis_url=f"redis://127.0.0.1:{tls_server.port}/0")
    with pytest.raises(Exception, match="unreachable at startup"):
        _startup(app)


def test_a_real_beat_with_a_wrong_ca_exits_naming_the_setting(
    processes: ProcessManager, tls_server: Node, tls: TlsFiles
) -> None:
    schedule = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}
    beat = processes.beat(BEAT_APP, env=beat_env(schedule, safe_time_redis_url=_url(tls_server, tls.other_ca)))
    assert beat.wait(60) != 0
    assert "safe_time_redis_url" in beat.log()
    assert "ssl_ca_certs" in beat.log()


def test_a_real_beat_over_tls_fires(
    processes: ProcessManager, redis_client: object, tls_server: Node, tls: TlsFiles
) -> None:
    schedule = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}
    env = beat_env(schedule, safe_time_redis_url=_url(tls_server, tls.ca), safe_time_beat_lease=3)
    processes.worker(BEAT_APP, env=env, name="worker")
    beat = processes.beat(BEAT_APP, env=env, name="beat")
    wait_for(lambda: len(runs(redis_client)) >= 2, 40, message="runs fired over a TLS lease")  # type: ignore[arg-type]
    assert beat.alive()


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Cluster nodes announce their IP: this certificate names 127.0.0.1.
    files = TlsFiles(tmp_path_factory.mktemp("tls-cluster-certs")).make()
    cluster = LocalCluster(tmp_path_factory.mktemp("tls-cluster"), tls=files).start()
    yield cluster
    cluster.stop()


def test_rediss_cluster_runs_leases_and_locks(make_app: Callable[..., Celery], tls_cluster: LocalCluster) -> None:
    app = make_app(safe_time_redis_url=tls_cluster.url)
    _startup(app)
    config = get_config(app)
    assert config.redis_cluster
    client = create_redis(config.redis_url)
    assert is_cluster(client)
    assert Lease(client, config).acquire(0.0) is not None
    owner = Owner(task_id="t", identity="t:0:0", host="h", pid=1)
    assert RedisLockBackend(client, config).acquire("k", "tok", 5, owner).status == "acquired"


def test_rediss_cluster_with_a_wrong_ca_fails_naming_the_setting(
    make_app: Callable[..., Celery], tls_cluster: LocalCluster, tls: TlsFiles
) -> None:
    assert tls_cluster.tls is not None
    url = tls_cluster.url.replace(str(tls_cluster.tls.ca), str(tls.other_ca))
    app = make_app(safe_time_redis_url=url)
    with pytest.raises(ImproperlyConfigured, match=r"safe_time_redis_url: TLS handshake.*ssl_ca_certs"):
        create_redis(get_config(app).redis_url)
    checks = {c.name: c for c in check_redis(get_config(app))}
    assert checks["redis"].status == "fail"
    assert "ssl_ca_certs" in checks["redis"].detail
