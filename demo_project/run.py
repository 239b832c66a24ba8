"""``make demo``: the whole story, live, in about two minutes.

Three ``celery beat`` processes and two workers run the demo SaaS with celery-safe-time; the
same jobs run on plain Celery beside them. Mid-way the leader beat is ``kill -9``-ed and the
broker is flushed while delays are pending. At the end a report compares expected and observed;
the exit code is 0 only when every expectation holds.

``--quick`` shortens the timeline (used by the test suite); ``--serve`` leaves the system
running with the Django admin on http://127.0.0.1:8000/admin/. ``--broker amqp`` (``make demo
BROKER=amqp``) runs the same story on a throwaway RabbitMQ node with a short ``consumer_timeout``;
leases and locks stay on Redis. ``--coord postgres`` (``make demo COORD=postgres``) puts the
coordination (beat lease, fired slots, locks, idempotency markers) and the Django store in a throwaway
database of the machine's PostgreSQL; with ``--broker amqp`` too, no Redis process runs at all (the
report checks it).

Redis: a throwaway ``redis-server`` the demo starts on a free loopback port, or, only when
``DEMO_REDIS_URL`` is set, that Redis, where the demo claims three empty databases and empties
only those at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from celery_safe_time.config import mask_url
from tests.helpers.services import REDIS_DEFAULT_PORT, RedisWatch

ROOT = Path(__file__).resolve().parents[1]
UTC = timezone.utc
CLAIM_KEY = "safe_time_test:db:{db}"  # the same claim keys as the test suite, so runs never collide
#: ``--coord postgres``: the PostgreSQL the demo makes its throwaway database on (the maintenance db).
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
#: Seconds between the sweeps the leader beat sends (``DEMO_SWEEP_INTERVAL``): a new leader's first
#: sweep comes at most this long after it takes over.
SWEEP_INTERVAL = 1.0


@dataclass
class Timeline:
    """Seconds from the start of the scenario; compressed durations stand in for days."""

    trial_seconds: float = 30.0
    extend_by: float = 15.0
    threshold: float = 3.0
    visibility_timeout: float = 10.0
    plain_visibility_timeout: float = 4.0
    plain_countdown: float = 14.0
    #: ``--broker amqp``: the throwaway node's consumer_timeout (30 min in production), and the plain
    #: side's countdown there: a few timeouts long, as 14 days are against 30 minutes. 20 s keeps the
    #: sweep's look-ahead at its 2 s cap (a tenth of the timeout), as on Redis.
    consumer_timeout: float = 20.0
    amqp_plain_countdown: float = 50.0
    lease: float = 6.0
    invoice_every: float = 4.0
    sync_every: float = 2.0
    sync_seconds: float = 3.0
    lock_ttl: float = 6.0
    nudges: int = 40
    nudge_spread: tuple[float, float] = (6.0, 40.0)
    start_trials_at: float = 4.0
    cancel_extend_at: float = 10.0
    kill_leader_at: float = 14.0
    flush_broker_at: float = 20.0
    run_until: float = 75.0

    @classmethod
    def quick(cls) -> Timeline:
        return cls(
            trial_seconds=18.0,
            extend_by=8.0,
            nudges=20,
            nudge_spread=(5.0, 22.0),
            plain_countdown=10.0,
            start_trials_at=3.0,
            cancel_extend_at=7.0,
            kill_leader_at=10.0,
            flush_broker_at=13.0,
            run_until=45.0,
        )


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    #: Where this process's lines start in ``log`` (a restarted process appends to the same file).
    log_offset: int = 0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def own_log(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class Demo:
    args: argparse.Namespace
    timeline: Timeline
    var: Path
    #: The Redis base URL, "" when the run needs none (``--coord postgres --broker amqp``).
    redis_base: str
    owned_redis: subprocess.Popen[bytes] | None = None
    #: ``--coord postgres``: the demo's own PostgreSQL database (store and coordination).
    postgres: PostgresDemoDatabase | None = None
    #: With no Redis in the run: the samples showing no Redis process and no connection to one.
    redis_watch: RedisWatch | None = None
    #: ``--broker amqp``: the demo's own RabbitMQ node and its two vhosts (safe side, plain side).
    rabbit: Any = None
    amqp_urls: dict[str, str] = field(default_factory=dict)
    #: ``--broker sqs``: the demo's own local SQS-compatible endpoint (both sides, queue prefixes apart).
    sqs: Any = None
    dbs: list[int] = field(default_factory=list)
    claim_token: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: list[Proc] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    t0: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)

    # --- plumbing ---------------------------------------------------------------------
    def url(self, db: int) -> str:
        return self.redis_base.rsplit("/", 1)[0] + f"/{db}"

    @property
    def broker_url(self) -> str:
        if self.sqs is not None:
            return str(self.sqs.url)
        return self.amqp_urls["safe"] if self.rabbit else self.url(self.dbs[0])

    @property
    def plain_broker_url(self) -> str:
        if self.sqs is not None:
            return str(self.sqs.url)
        return self.amqp_urls["plain"] if self.rabbit else self.plain_url

    @property
    def safe_redis_url(self) -> str:
        return self.url(self.dbs[1])

    @property
    def plain_url(self) -> str:
        """Where the plain side records its runs: its Redis, or a directory when no Redis runs."""
        if not self.redis_base:
            return (self.var / "plain-records").as_uri()
        return self.url(self.dbs[2])

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.t0 if self.t0 else 0.0
        self.events.append((elapsed, message))
        print(f"[{elapsed:6.1f}s] {message}", flush=True)

    def env(self) -> dict[str, str]:
        tl = self.timeline
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "demo_project.settings",
            "DEMO_VAR_DIR": str(self.var),
            "DEMO_BROKER_URL": self.broker_url,
            "DEMO_PLAIN_BROKER_URL": self.plain_broker_url,
            "DEMO_PLAIN_RECORD_URL": self.plain_url,
            "DEMO_KEY_PREFIX": "demo:",
            "DEMO_BEAT_LEASE": str(tl.lease),
            "DEMO_DELAY_THRESHOLD": str(tl.threshold),
            "DEMO_VISIBILITY_TIMEOUT": str(tl.visibility_timeout),
            "DEMO_PLAIN_VISIBILITY_TIMEOUT": str(tl.plain_visibility_timeout),
            "DEMO_SWEEP_INTERVAL": str(SWEEP_INTERVAL),
            "DEMO_TRIAL_SECONDS": str(tl.trial_seconds),
            "DEMO_SYNC_SECONDS": str(tl.sync_seconds),
            "DEMO_SYNC_EVERY": str(tl.sync_every),
            "DEMO_INVOICE_EVERY": str(tl.invoice_every),
            "DEMO_LOCK_TTL": str(tl.lock_ttl),
            "DEMO_RESTORE_INTERVAL": "1",
            "DEMO_RESTORE_THROTTLE": "1",
        }
        if self.rabbit:
            env["DEMO_CONSUMER_TIMEOUT"] = str(tl.consumer_timeout)
        if self.sqs is not None:
            env["DEMO_SQS_QUEUE_PREFIX"] = "demo-safe-"
            env["DEMO_PLAIN_SQS_QUEUE_PREFIX"] = "demo-plain-"
        if self.postgres is not None:
            env["DATABASE_URL"] = self.postgres.url
            env["DEMO_COORDINATION_URL"] = "store"  # the Django database: one PostgreSQL for everything
            env.pop("DEMO_REDIS_URL", None)
        else:
            env.pop("DEMO_COORDINATION_URL", None)
            env["DEMO_REDIS_URL"] = self.safe_redis_url
        return env

    def spawn(self, name: str, *args: str) -> Proc:
        log = self.var / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", *args],
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(self.var),
                start_new_session=True,
            )
        proc = Proc(name, popen, log, offset)
        self.procs.append(proc)
        return proc

    def beat(self, name: str, app: str, *args: str) -> Proc:
        schedule = str(self.var / f"{name}.schedule")
        return self.spawn(name, "celery", "-A", app, "beat", "-l", "INFO", *args, "-s", schedule)

    def worker(self, name: str, app: str, concurrency: int, hostname: str) -> Proc:
        return self.spawn(
            name,
            *("celery", "-A", app, "worker", "-l", "INFO", "-c", str(concurrency), "-n", hostname),
            *("--without-gossip", "--without-mingle"),
        )

    def manage(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "demo_project.manage", *args],
            env=self.env(),
            cwd=str(self.var),
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"manage.py {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    # --- services ---------------------------------------------------------------------
    def claim_redis(self) -> None:
        """Claim three empty databases (1-15): never one holding keys the demo did not write.

        The claim is the test suite's (a key in db 0 with a TTL), so a test run and a demo sharing a
        Redis never take the same database; an empty database another run claimed is skipped too.
        """
        client = redis.Redis.from_url(self.url(0))
        holding_keys: list[int] = []
        for db in range(15, 0, -1):
            if len(self.dbs) == 3:
                break
            database = redis.Redis.from_url(self.url(db))
            if database.dbsize():
                holding_keys.append(db)
                continue
            if not client.set(CLAIM_KEY.format(db=db), self.claim_token, nx=True, ex=1800):
                continue
            if database.dbsize():  # written between the look and the claim: not ours to empty
                client.delete(CLAIM_KEY.format(db=db))
                holding_keys.append(db)
                continue
            self.dbs.append(db)
        if len(self.dbs) < 3:
            claimed, self.dbs = self.dbs, []
            for db in claimed:
                client.delete(CLAIM_KEY.format(db=db))
            raise SystemExit(
                f"DEMO_REDIS_URL={mask_url(self.redis_base)}: the demo needs three empty databases among 1-15 and "
                f"found {len(claimed)} (holding keys: {sorted(holding_keys) or 'none'}; the rest are claimed by a "
                "test run or another demo). It never empties a database holding keys it did not write: empty "
                "some yourself, or unset DEMO_REDIS_URL to let the demo start a redis-server of its own."
            )

    def release(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.signal(signal.SIGKILL)
        try:
            client = redis.Redis.from_url(self.url(0)) if self.dbs else None
            for db in self.dbs:
                if client is not None and client.get(CLAIM_KEY.format(db=db)) == self.claim_token.encode():
                    redis.Redis.from_url(self.url(db)).flushdb()
                    client.delete(CLAIM_KEY.format(db=db))
        except redis.RedisError:
            pass
        if self.owned_redis is not None:
            self.owned_redis.terminate()
        if self.rabbit is not None:
            self.rabbit.stop()
        if self.sqs is not None:
            self.sqs.stop()
        if self.postgres is not None:
            self.postgres.drop()


def find_redis(var: Path) -> tuple[str, subprocess.Popen[bytes] | None]:
    """The Redis of the demo: ``DEMO_REDIS_URL`` when set, else a throwaway redis-server of its own."""
    if os.environ.get("DEMO_REDIS") and not os.environ.get("DEMO_REDIS_URL"):
        raise SystemExit("DEMO_REDIS is now DEMO_REDIS_URL (only its empty databases are used)")
    url = os.environ.get("DEMO_REDIS_URL")
    if url:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        except redis.RedisError as exc:
            raise SystemExit(f"DEMO_REDIS_URL={mask_url(url)} did not answer PING: {exc}") from None
        print(f"using the Redis at DEMO_REDIS_URL={mask_url(url)} (only empty databases, emptied again at the end)")
        return url, None
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "make demo starts a throwaway redis-server of its own, and none is installed: apt-get install "
            "redis-server, or lend it a Redis with DEMO_REDIS_URL=redis://HOST:PORT (it then uses three empty "
            "databases of it, and empties only those)"
        )
    for _attempt in range(3):  # the free port may be taken before redis-server binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=str(var),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(200):
            if proc.poll() is not None:
                break
            try:
                if redis.Redis.from_url(url).ping():
                    print(f"started a throwaway redis-server on 127.0.0.1:{port} (no other Redis is touched)")
                    return url, proc
            except redis.RedisError:
                time.sleep(0.05)
        proc.terminate()
    raise SystemExit("the throwaway redis-server did not start")


class PostgresDemoDatabase:
    """``--coord postgres``: a database of the demo's own on the machine's PostgreSQL, dropped at the end.

    Its name is new each run (``safe_time_demo_<pid>_<random>``); only that database is created and
    dropped, never another one of the server.
    """

    def __init__(self, admin_url: str) -> None:
        import psycopg

        self.admin_url = admin_url.replace("postgresql+psycopg://", "postgresql://", 1)  # psycopg's own form
        admin_url = self.admin_url
        self.name = f"safe_time_demo_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        try:
            with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE DATABASE "{self.name}"')
        except psycopg.Error as exc:
            raise SystemExit(
                f"make demo COORD=postgres creates a throwaway database on DEMO_POSTGRES_URL={mask_url(admin_url)} "
                f"(default {DEFAULT_POSTGRES_URL}) and could not: {exc}"
            ) from None
        parts = urlsplit(admin_url)
        self.url = urlunsplit((parts.scheme, parts.netloc, f"/{self.name}", "", ""))
        self.dropped = False

    def drop(self) -> None:
        """Drop the demo's database (its connections closed first); the only database it ever drops."""
        if self.dropped:
            return
        import psycopg

        try:
            with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            self.dropped = True
        except psycopg.Error as exc:
            print(f"could not drop the demo's database {self.name}: {exc}", file=sys.stderr)


def start_postgres(demo: Demo) -> None:
    admin_url = os.environ.get("DEMO_POSTGRES_URL") or DEFAULT_POSTGRES_URL
    demo.postgres = PostgresDemoDatabase(admin_url)
    print(
        f"created a throwaway PostgreSQL database {demo.postgres.name} on {mask_url(admin_url).rsplit('/', 1)[0]} "
        "(store and coordination; dropped at the end, no other database is touched)"
    )


def start_rabbit(demo: Demo) -> None:
    """``--broker amqp``: a RabbitMQ node of the demo's own with a short consumer_timeout.

    The machine's RabbitMQ keeps its settings: consumer_timeout is node-wide on RabbitMQ 3.10
    (``x-consumer-timeout`` per queue needs 3.12+), so a second node on loopback ports carries it.
    """
    server = shutil.which("rabbitmq-server") or "/usr/lib/rabbitmq/bin/rabbitmq-server"
    if not os.access(server, os.X_OK):
        raise SystemExit("make demo BROKER=amqp starts a RabbitMQ node of its own: apt-get install rabbitmq-server")
    from tests.helpers.services import RabbitNode

    tl = demo.timeline
    node = RabbitNode(demo.var / "rabbitmq", consumer_timeout_ms=int(tl.consumer_timeout * 1000))
    demo.rabbit = node.start()
    demo.amqp_urls = {"safe": node.vhost(), "plain": node.vhost()}
    print(
        f"started a throwaway RabbitMQ node on 127.0.0.1:{node.port} with consumer_timeout {tl.consumer_timeout:g}s "
        "(30 min in production); the machine's RabbitMQ is not touched"
    )


def start_sqs(demo: Demo) -> None:
    """``--broker sqs``: a local SQS-compatible endpoint of the demo's own (moto's server mode, from
    the ``dev`` extra) on a free loopback port; both sides on it, their queues apart by name prefix."""
    from tests.helpers.services import SqsEndpoint

    demo.sqs = SqsEndpoint().start()
    print(
        f"started a local SQS-compatible endpoint (moto) on {demo.sqs.endpoint}; visibility_timeout "
        f"{demo.timeline.visibility_timeout:g}s (plain side: {demo.timeline.plain_visibility_timeout:g}s)"
    )


# --- the scenario -------------------------------------------------------------------------


def setup_django(demo: Demo) -> Any:
    os.environ.update(demo.env())
    demo.manage("migrate", "--noinput")
    from demo_project.celery_app import app

    return app


def leader_pid(app: Any) -> int | None:
    """The pid of the beat holding the lease, read from the status API."""
    from celery_safe_time.beat.admin import describe_beat

    info = describe_beat(app)
    leader = info.get("leader") or {}
    pid = leader.get("pid") if isinstance(leader, dict) else None
    return int(pid) if pid else None


def create_tenants() -> list[Any]:
    from demo_project.tenants.models import Tenant

    zones = ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Tokyo", "UTC"]
    return [Tenant.objects.create(name=f"tenant-{i + 1}", timezone=tz) for i, tz in enumerate(zones)]


def scenario(demo: Demo) -> int:
    tl = demo.timeline
    app = setup_django(demo)
    from celery_safe_time import get_config, save_entry
    from demo_project.billing.tasks import schedule_morning_reminder, send_invoice
    from demo_project.plain_app import app as plain_app
    from demo_project.tenants.models import Tenant
    from demo_project.trials.tasks import extend_trial, nudge, start_trial, upgrade

    cfg = get_config(app)
    tenants = create_tenants()
    if demo.postgres is not None:
        where = f"PostgreSQL database {demo.postgres.name} (safe_time_coordination_url = 'store')"
        store = f"PostgreSQL database {demo.postgres.name}"
    else:
        where, store = demo.safe_redis_url, str(demo.var / "demo.sqlite3")
    demo.say(
        f"safe side: broker {mask_url(demo.broker_url)}, locks/leases {where}, store = Django DB "
        f"({store}); plain Celery side: {mask_url(demo.plain_broker_url)}"
    )
    if demo.redis_watch is not None:
        demo.say(f"no Redis in this run: safe_time_redis_url {cfg.redis_url or 'unset'}, no redis-server started")
    broker_limit = (
        f"consumer_timeout {tl.consumer_timeout:g}s (both sides)"
        if demo.rabbit
        else f"visibility_timeout {tl.visibility_timeout:g}s (plain: {tl.plain_visibility_timeout:g}s)"
    )
    demo.say(
        f'compressed time: trial {tl.trial_seconds:g}s ("14 days"), delay threshold {cfg.delay_threshold:g}s, '
        f"{broker_limit}, lease {tl.lease:g}s"
    )

    safe_mod, plain_mod = "demo_project.celery_app", "demo_project.plain_app"
    beats = [demo.beat(f"beat{i}", safe_mod, "-S", demo.args.scheduler) for i in (1, 2, 3)]
    workers = [demo.worker(f"worker{i}", safe_mod, 4, f"safe{i}@%h") for i in (1, 2)]
    plain_beats = [demo.beat(f"plain-beat{i}", plain_mod) for i in (1, 2, 3)]
    plain_workers = [demo.worker(f"plain-worker{i}", plain_mod, 2, f"plain{i}@%h") for i in (1, 2)]
    demo.say("started 3 safe beats, 2 safe workers, 3 plain beats, 2 plain workers; waiting until they are ready")
    wait_ready(demo, app, workers + plain_workers)
    demo.t0 = time.monotonic()
    demo.events.clear()
    demo.say("clock starts")
    if demo.redis_watch is not None:
        demo.redis_watch.sample()  # every process up and connected: the first look

    phase = {"trials": False, "cancel": False, "kill": False, "flush": False}
    kill_at: float | None = None
    killed_pid: int | None = None
    first_leader: int | None = None
    nudge_due: list[float] = []
    trial_ids: dict[int, str] = {}
    plain_ids: list[str] = []
    last_status = 0.0
    while True:
        now = time.monotonic() - demo.t0
        if now >= tl.run_until:
            break
        pid = _safe(lambda: leader_pid(app))
        if pid and first_leader is None:
            first_leader = pid
            demo.say(f"leader elected: {_name_of(demo, pid)}")
        if not phase["trials"] and now >= tl.start_trials_at:
            phase["trials"] = True
            for tenant in tenants:
                trial_ids[tenant.id] = start_trial(tenant)
                schedule_morning_reminder(tenant)
            for i in range(tl.nudges):
                delay = tl.nudge_spread[0] + (tl.nudge_spread[1] - tl.nudge_spread[0]) * i / max(1, tl.nudges - 1)
                due = time.time() + delay
                nudge.apply_async((tenants[i % len(tenants)].id, due), countdown=delay)
                nudge_due.append(due)
            # One tenant's own schedule, added at runtime while the three beats run (no restart):
            # in production "09:00 in the tenant's timezone", crontab(minute=0, hour=9, tz=tenant.timezone).
            report_tenant = tenants[0]
            runtime = "Database" not in demo.args.scheduler  # SafeDatabaseScheduler keeps its own tables
            if runtime:
                save_entry(
                    f"tenant-{report_tenant.id}-report",
                    "demo_project.billing.tasks.send_usage_report",
                    timedelta(seconds=tl.invoice_every),
                    args=(report_tenant.id,),
                    app=app,
                )
                demo.say(f"save_entry: {report_tenant.name}'s report every {tl.invoice_every:g}s, beats not restarted")
            demo.facts["report_added"] = runtime
            # A client that retries: the same invoice requested twice must be sent once.
            for _ in range(2):
                send_invoice.delay(tenants[0].id, "manual-2026-11")
            for tenant in tenants:
                plain_ids.append(
                    plain_app.send_task("plain.trial_ending_email", args=[tenant.id], countdown=tl.plain_countdown).id
                )
            demo.say(
                f"{len(tenants)} trials started (countdown {tl.trial_seconds:g}s), {len(tenants)} reminders at 09:00 "
                f"local, {tl.nudges} nudges (countdowns {tl.nudge_spread[0]:g}-{tl.nudge_spread[1]:g}s) -> store; "
                f"plain: {len(tenants)} countdowns of {tl.plain_countdown:g}s -> broker"
            )
        if not phase["cancel"] and now >= tl.cancel_extend_at:
            phase["cancel"] = True
            upgraded = upgrade(Tenant.objects.get(pk=tenants[1].id))
            extended = extend_trial(Tenant.objects.get(pk=tenants[2].id), timedelta(seconds=tl.extend_by))
            demo.say(
                f"{tenants[1].name} upgraded -> trial email cancelled ({upgraded}); "
                f"{tenants[2].name} trial extended by {tl.extend_by:g}s ({extended})"
            )
        if not phase["kill"] and now >= tl.kill_leader_at and pid:
            phase["kill"] = True
            victim = next((b for b in beats if b.popen.pid == pid), None)
            if victim is not None:
                victim.signal(signal.SIGKILL)
                kill_at, killed_pid = time.monotonic(), pid
                demo.facts["killed_at"] = time.time()  # wall clock, as the nudges' due times
                demo.say(f"kill -9 leader {victim.name} (pid {pid})")
        if kill_at is not None and "failover" not in demo.facts and pid and pid != killed_pid:
            demo.facts["failover"] = time.monotonic() - kill_at
            demo.facts["took_over_at"] = time.time()
            demo.say(f"standby {_name_of(demo, pid)} took over after {demo.facts['failover']:.1f}s")
        if not phase["flush"] and now >= tl.flush_broker_at:
            phase["flush"] = True
            if demo.rabbit or demo.sqs is not None:
                with app.connection_for_write() as conn:
                    purged = conn.default_channel.queue_purge(app.conf.task_default_queue)
                demo.say(f"purged the broker's queue ({purged} messages) while trial emails and nudges are pending")
            else:
                redis.Redis.from_url(demo.broker_url).flushdb()
                demo.say("FLUSHDB on the broker while trial emails and nudges are pending")
        for i, proc in enumerate(plain_workers):
            if not proc.alive():  # restarted as systemd or Kubernetes would; counted in the report
                log = proc.own_log()
                reason = "PRECONDITION_FAILED" if "PRECONDITION_FAILED" in log else f"exit {proc.popen.returncode}"
                demo.facts.setdefault("plain_exits", []).append(reason)
                plain_workers[i] = demo.worker(proc.name, plain_mod, 2, f"plain{i + 1}@%h")
                demo.say(f"plain {proc.name} exited ({reason}); restarted")
        if now - last_status >= 5:
            last_status = now
            demo.say(status_line(demo))
            if demo.redis_watch is not None:
                demo.redis_watch.sample()
        time.sleep(0.2)

    demo.facts.update(nudge_due=nudge_due, trial_ids=trial_ids, plain_ids=plain_ids)
    watch = demo.redis_watch
    if watch is not None:
        watch.sample()  # once more with every process still up
        demo.say(
            f"no-Redis check: {watch.samples} looks at the run's processes (up to {watch.most_processes}): "
            f"redis processes {sorted(watch.redis_processes) or 'none'}, "
            f"connections to :{REDIS_DEFAULT_PORT} {sorted(watch.redis_connections) or 'none'}"
        )
    demo.facts["safe_workers_up"] = all(w.alive() and "PRECONDITION_FAILED" not in w.own_log() for w in workers)
    for proc in beats + plain_beats:
        proc.signal(signal.SIGTERM)
    time.sleep(tl.sync_seconds + 1)  # let running syncs finish
    for proc in workers + plain_workers:
        proc.signal(signal.SIGTERM)
    for proc in demo.procs:
        try:
            proc.popen.wait(20)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
    demo.say("all processes stopped")
    return report(demo, app)


def wait_ready(demo: Demo, app: Any, workers: list[Proc], timeout: float = 120.0) -> None:
    """Start the clock once every worker is consuming and a leader beat holds the lease."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = all("ready." in w.log.read_text(errors="replace") for w in workers if w.log.exists())
        if ready and _safe(lambda: leader_pid(app)):
            return
        dead = [p.name for p in demo.procs if not p.alive()]
        if dead:
            raise SystemExit(f"{', '.join(dead)} exited during startup; logs in {demo.var}")
        time.sleep(0.3)
    raise SystemExit(f"processes not ready after {timeout:g}s; logs in {demo.var}")


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _name_of(demo: Demo, pid: int) -> str:
    return next((p.name for p in demo.procs if p.popen.pid == pid), f"pid {pid}")


def status_line(demo: Demo) -> str:
    from celery_safe_time.contrib.django.models import DelayedTask
    from demo_project.billing.models import InvoiceRun
    from demo_project.inventory.models import SyncRun
    from demo_project.plain_app import records
    from demo_project.tenants.models import Email

    pending = DelayedTask.objects.filter(status="pending").count()
    return (
        f"slots fired {InvoiceRun.objects.values('slot').distinct().count()} | "
        f"emails {Email.objects.count()} | syncs {SyncRun.objects.count()} | pending delays {pending} | "
        f"plain beat runs {len(records('plain:invoice_runs', demo.plain_url))}"
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _clusters(times: list[float], gap: float) -> int:
    """Runs closer than ``gap`` seconds belong to one slot (plain beats fire each on their own tick)."""
    count, last = 0, None
    for t in sorted(times):
        if last is None or t - last > gap:
            count += 1
        last = t
    return count


def _by_slot(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """The task ids of the runs of each slot."""
    runs: defaultdict[str, list[str]] = defaultdict(list)
    for slot, task_id in pairs:
        runs[slot].append(task_id)
    return dict(runs)


def report(demo: Demo, app: Any) -> int:
    from celery_safe_time import get_config
    from celery_safe_time.contrib.django.models import DelayedTask
    from demo_project.billing.models import InvoiceRun
    from demo_project.inventory.models import SyncRun
    from demo_project.tenants.models import Email, Tenant

    tl = demo.timeline
    rows: list[tuple[str, str, str, bool]] = []

    def row(what: str, expected: str, observed: object, ok: bool) -> None:
        rows.append((what, expected, str(observed), ok))

    # The task ids of each slot's runs. Each publish of a slot is a task id of its own. One id run
    # twice is one message the broker delivered again (Redis and SQS redeliver a message a worker
    # held unacked past visibility_timeout, prefetched behind busy pool processes): at-least-once
    # delivery, which the idempotent invoices below absorb, not a second publish.
    slots = _by_slot(InvoiceRun.objects.values_list("slot", "task_id"))
    published = {slot: len(set(ids)) for slot, ids in slots.items()}
    row(f"invoice slots fired (every {tl.invoice_every:g}s)", "> 0", len(slots), len(slots) > 0)
    row("  slots published twice", "0", sum(n - 1 for n in published.values()), all(n == 1 for n in published.values()))
    for slot in sorted(s for s, ids in slots.items() if len(ids) > 1):
        runs = InvoiceRun.objects.filter(slot=slot).order_by("started_at")
        detail = "; ".join(f"{r.task_id} on {r.hostname} at {r.started_at:%H:%M:%S.%f}" for r in runs)
        cause = "published twice" if published[slot] > 1 else "one message delivered again by the broker"
        demo.facts.setdefault("notes", []).append(f"slot {slot} ran {len(runs)} times ({cause}): {detail}")
    failover = demo.facts.get("failover")
    limit = tl.lease + tl.lease / 3
    instants = sorted(datetime.fromisoformat(s).timestamp() for s in slots if s and s[0].isdigit())
    # With run_once, the slots missed while no leader lived collapse into one catch-up; any other
    # hole in the grid would be a slot lost while a leader was alive.
    holes = [b - a for a, b in itertools.pairwise(instants) if b - a > tl.invoice_every * 1.5]
    allowed = 1 if failover is not None else 0
    row(
        "  grid holes (only the failover's)",
        f"<= {allowed}",
        len(holes),
        len(holes) <= allowed and all(h <= limit + tl.invoice_every for h in holes),
    )
    row(
        "failover after kill -9 of the leader",
        f"<= {limit:g}s (lease + lease/3)",
        "not observed" if failover is None else f"{failover:.1f}s",
        failover is not None and failover <= limit + 1,
    )

    report_ids = _by_slot(Email.objects.filter(kind="usage_report").values_list("key", "task_id"))
    if demo.facts.get("report_added"):
        row(
            f"tenant report added at runtime (save_entry, every {tl.invoice_every:g}s)",
            "> 0",
            len(report_ids),
            len(report_ids) > 0,
        )
        twice = {key: len(set(ids)) - 1 for key, ids in report_ids.items()}
        row("  report slots sent twice", "0", sum(twice.values()), not any(twice.values()))
        redelivered = sorted(key for key, ids in report_ids.items() if len(ids) > len(set(ids)))
        if redelivered:
            demo.facts.setdefault("notes", []).append(
                f"report slots run again from one message the broker delivered again: {', '.join(redelivered)}"
            )

    trials = list(Email.objects.filter(kind="trial_ending").values_list("tenant_id", flat=True))
    upgraded = Tenant.objects.filter(plan="paid").values_list("id", flat=True)
    expected_trials = {t.id for t in Tenant.objects.all()} - set(upgraded)
    row("trial-ending emails sent", str(len(expected_trials)), len(trials), sorted(trials) == sorted(expected_trials))
    extended = Tenant.objects.get(name="tenant-3")
    extended_sent = Email.objects.filter(kind="trial_ending", tenant=extended).values_list("sent_at", flat=True)
    on_time = bool(extended_sent) and extended.trial_ends_at is not None
    on_time = on_time and all(
        abs((s - extended.trial_ends_at).total_seconds()) < tl.extend_by / 2 for s in extended_sent
    )
    row("  extended trial: email at the new end", "yes", "yes" if on_time else "no", on_time)
    cancelled = DelayedTask.objects.filter(status="cancelled").count()
    row("  cancelled on upgrade (not sent)", "1", cancelled, cancelled == 1 and not set(upgraded) & set(trials))
    nudge_keys = Counter(Email.objects.filter(kind="nudge").values_list("key", flat=True))
    lost = len(demo.facts["nudge_due"]) - len(nudge_keys)
    row(
        f"  delayed emails lost (broker {'flushed' if demo.args.broker == 'redis' else 'queue purged'} mid-way)",
        "0",
        lost + len(expected_trials - set(trials)),
        lost == 0 and not expected_trials - set(trials),
    )
    row(
        "  delayed emails run twice",
        "0",
        sum(n - 1 for n in nudge_keys.values()) + len(trials) - len(set(trials)),
        all(n == 1 for n in nudge_keys.values()) and len(trials) == len(set(trials)),
    )

    if demo.rabbit:
        survived = bool(demo.facts.get("safe_workers_up")) and lost == 0 and not expected_trials - set(trials)
        survived = survived and all(n == 1 for n in nudge_keys.values()) and len(trials) == len(set(trials))
        row(
            f"SafeTask worker stayed up (consumer_timeout {tl.consumer_timeout:g}s), every delay ran once",
            "yes",
            "yes" if survived else "no",
            survived,
        )

    # A tenant whose 09:00 falls inside the run (New York's at 14:00 UTC) is swept and sent on time:
    # what matters is that every reminder went to the store and only the due ones left it.
    reminder_rows = DelayedTask.objects.filter(task__endswith="send_reminder")
    stored = reminder_rows.count()
    ended = datetime.now(UTC)
    # A sweep may claim a row a few seconds ahead of its due time (its look-ahead), never a minute.
    left_early = reminder_rows.exclude(status="pending").filter(due_at__gt=ended + timedelta(seconds=60)).count()
    overdue = reminder_rows.filter(status="pending", due_at__lte=ended - timedelta(seconds=5)).count()
    waiting = reminder_rows.filter(status="pending").count()
    row(
        "09:00-local reminders in the store (waiting, not due)",
        "5",
        f"{stored} ({waiting})",
        stored == 5 and left_early == 0 and overdue == 0,
    )

    overlaps = 0
    runs_by_account: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for account_id, started, finished in SyncRun.objects.values_list("account_id", "started", "finished"):
        runs_by_account[account_id].append((started, finished))
    for runs in runs_by_account.values():
        runs.sort()
        overlaps += sum(1 for a, b in itertools.pairwise(runs) if b[0] < a[1])
    syncs = sum(len(r) for r in runs_by_account.values())
    row(f"inventory syncs ({tl.sync_seconds:g}s long, every {tl.sync_every:g}s)", "> 0", syncs, syncs > 0)
    row("  overlapping syncs of one account", "0", overlaps, overlaps == 0)

    invoices = Counter(Email.objects.filter(kind="invoice").values_list("key", flat=True))
    row("invoices sent", "> 0", sum(invoices.values()), bool(invoices))
    row(
        "  duplicate invoices (one requested twice on purpose)",
        "0",
        sum(n - 1 for n in invoices.values()),
        all(n == 1 for n in invoices.values()),
    )

    watch = demo.redis_watch
    if watch is not None:
        # Honest, not assumed: the demo started no redis-server, the app has no Redis setting, and
        # no process of the run was a Redis or held a connection to the Redis port when looked at.
        found = sorted(watch.redis_processes | watch.redis_connections)
        no_redis = watch.clean and demo.owned_redis is None and not get_config(app).redis_url
        row(
            f"no Redis process ran (none started, none connected to :{REDIS_DEFAULT_PORT})",
            "none",
            "none" if no_redis else ", ".join(found) or "safe_time_redis_url set",
            no_redis,
        )

    # No leader, no sweep: the nudges due from the kill -9 until the new leader's first sweep (one sweep
    # interval after it took over) wait for that sweep: the failover (up to lease + lease/3, with the
    # failover row's second of slack) and one sweep interval; the p99 row holds them to it. The p50 row
    # is the lateness while a leader sweeps (published ahead with their eta: on time).
    # The quick timeline's nudges are due over 17 s and the failover takes up to 8 s of them, so with
    # them in, the p50 says how long the failover took under load, not how late the sweep delivers.
    paused_from = demo.facts.get("killed_at", float("inf"))
    paused_until = demo.facts.get("took_over_at", float("inf")) + SWEEP_INTERVAL
    lateness, steady = [], []
    for key, sent_at in Email.objects.filter(kind="nudge").values_list("key", "sent_at"):
        late = sent_at.timestamp() - float(key)
        lateness.append(late)
        if not paused_from <= float(key) <= paused_until:
            steady.append(late)
    p50, p99 = _percentile(steady, 50), _percentile(lateness, 99)
    paused_limit = limit + 1 + SWEEP_INTERVAL
    row(f"stored-delay lateness p50 (the {len(steady)} due while a leader swept)", "<= 1s", f"{p50:.2f}s", p50 <= 1.0)
    row(
        f"stored-delay lateness p99 (all {len(lateness)})",
        f"<= {paused_limit:g}s (a failover pauses sweeps)",
        f"{p99:.2f}s",
        p99 <= paused_limit,
    )

    # --- plain Celery, same scenario ---
    from demo_project.plain_app import records

    plain_runs = [r["at"] for r in records("plain:invoice_runs", demo.plain_url)]
    plain_slots = _clusters(plain_runs, tl.invoice_every / 2)
    plain_trials = Counter(r["tenant"] for r in records("plain:trial_emails", demo.plain_url))
    baseline = [
        ("invoice slots fired by 3 plain beats", str(plain_slots)),
        ("  runs published (duplicates)", f"{len(plain_runs)} ({len(plain_runs) - plain_slots})"),
    ]
    runs_per_email = f"{sum(plain_trials.values())} runs for {len(demo.facts['plain_ids'])} emails"
    countdown = f"countdown {tl.plain_countdown:g}s"
    if demo.rabbit:
        exits = demo.facts.get("plain_exits", [])
        killed = exits.count("PRECONDITION_FAILED")
        baseline += [
            (
                f"plain worker killed by consumer_timeout {tl.consumer_timeout:g}s",
                f"yes ({killed} exits with PRECONDITION_FAILED, each restarted)" if killed else "no",
            ),
            (
                f"{countdown} > consumer_timeout {tl.consumer_timeout:g}s: runs per email",
                runs_per_email,
            ),
        ]
    else:
        baseline.append(
            (
                f"{countdown} > visibility_timeout {tl.plain_visibility_timeout:g}s: runs per email",
                runs_per_email,
            )
        )

    width = max(len(r[0]) for r in rows) + 2
    exp_width = max(len(r[1]) for r in rows) + 2
    line = "-" * (width + exp_width + 16)
    print()
    print("celery-safe-time demo report")
    print(f"{'what':<{width}}{'expected':<{exp_width}}{'observed':<12}ok")
    print(line)
    for what, expected, observed, ok in rows:
        print(f"{what:<{width}}{expected:<{exp_width}}{observed:<12}{'yes' if ok else 'NO'}")
    print()
    print("plain Celery, same run (the problems this package fixes)")
    print(line)
    base_width = max(len(b[0]) for b in baseline) + 2
    for what, observed in baseline:
        print(f"{what:<{base_width}}{observed}")
    all_ok = all(r[3] for r in rows)
    print()
    for note in demo.facts.get("notes", []):
        print(note)
    print("ALL EXPECTATIONS MET" if all_ok else f"SOME EXPECTATIONS FAILED (logs in {demo.var})")
    demo.facts["rows"] = rows
    (demo.var / "report.json").write_text(json.dumps({"rows": rows, "baseline": baseline}, indent=2))
    return 0 if all_ok else 1


def serve(demo: Demo) -> int:
    setup_django(demo)
    password = secrets.token_urlsafe(9)
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    if not user_model.objects.filter(username="admin").exists():
        user_model.objects.create_superuser("admin", "admin@example.com", password)
    else:
        user = user_model.objects.get(username="admin")
        user.set_password(password)
        user.save()
    from demo_project.tenants.models import Tenant
    from demo_project.trials.tasks import start_trial

    if not Tenant.objects.exists():
        for tenant in create_tenants():
            start_trial(tenant)
    demo.beat("beat1", "demo_project.celery_app", "-S", demo.args.scheduler)
    demo.worker("worker1", "demo_project.celery_app", 4, "safe1@%h")
    # --insecure: runserver serves the admin's CSS/JS from the installed apps even with DEBUG off
    # (a local demo, no collectstatic step, no extra dependency); production serves them itself.
    demo.spawn("web", "demo_project.manage", "runserver", "--noreload", "--insecure", f"127.0.0.1:{demo.args.port}")
    print(f"admin: http://127.0.0.1:{demo.args.port}/admin/  user: admin  password: {password}")
    print(f"logs in {demo.var}; Ctrl-C to stop")
    try:
        while all(p.alive() for p in demo.procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    return 0


def _interrupted(signum: int, frame: Any) -> None:
    # The first signal ends the run; a second one (a supervisor signalling the whole process group,
    # as `timeout` does) must not cut the cleanup short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter timeline (about a minute)")
    parser.add_argument("--serve", action="store_true", help="leave it running with the Django admin")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--scheduler",
        default="celery_safe_time.SafeScheduler",
        help="beat scheduler class (or celery_safe_time.contrib.django.SafeDatabaseScheduler)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, SQLite database)")
    parser.add_argument(
        "--coord",
        choices=["redis", "postgres"],
        default="redis",
        help="postgres: leases, fired slots, locks and idempotency markers (and the store) in a throwaway "
        "PostgreSQL database (make demo COORD=postgres); with --broker amqp no Redis runs at all",
    )
    parser.add_argument(
        "--broker",
        choices=["redis", "amqp", "sqs"],
        default="redis",
        help="amqp: the same story on a throwaway RabbitMQ node (make demo BROKER=amqp); sqs: on a local "
        "SQS-compatible endpoint (make demo BROKER=sqs); leases, locks on Redis",
    )
    args = parser.parse_args(argv)
    var = Path(tempfile.mkdtemp(prefix="safe-time-demo-"))
    # Redis serves as the broker (BROKER=redis) or the coordination (COORD=redis); with neither, the
    # demo starts none and never connects to one.
    needs_redis = args.broker == "redis" or args.coord == "redis"
    redis_base, owned = find_redis(var) if needs_redis else ("", None)
    timeline = Timeline.quick() if args.quick else Timeline()
    if args.broker == "amqp":
        timeline = dataclasses.replace(timeline, plain_countdown=timeline.amqp_plain_countdown)
    demo = Demo(args, timeline, var, redis_base, owned)
    started = datetime.now(UTC)
    # `kill PID` (or Ctrl-C where a shell ignores SIGINT for background jobs) ends the demo as Ctrl-C
    # does: through the `finally` below, which stops its processes and drops its PostgreSQL database.
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        if needs_redis:
            demo.claim_redis()
        else:
            demo.redis_watch = RedisWatch()
            (var / "plain-records").mkdir()
            print("no Redis in this run: broker RabbitMQ, coordination PostgreSQL; no redis-server is started")
        if args.coord == "postgres":
            start_postgres(demo)
        if args.broker == "amqp":
            start_rabbit(demo)
        if args.broker == "sqs":
            start_sqs(demo)
        code = serve(demo) if args.serve else scenario(demo)
    finally:
        demo.release()
        if not args.keep and not args.serve and demo.facts.get("rows") and all(r[3] for r in demo.facts["rows"]):
            shutil.rmtree(var, ignore_errors=True)
    print(f"demo finished in {(datetime.now(UTC) - started).total_seconds():.0f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
