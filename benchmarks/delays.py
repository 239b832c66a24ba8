"""Durable delays, measured side by side with plain Celery / raw kombu in the same run.

``python -m benchmarks.delays [--quick]`` prints a markdown table; ``run(quick)`` returns the numbers.

1. Worker RSS growth with N pending 2-hour countdowns: plain Celery vs SafeTask; bytes per stored row.
2. Sweeper throughput on PostgreSQL (rows published per second), 1 and 4 sweepers, next to a raw
   kombu publish of the same messages.
3. Claim-query time with 0 and with many not-yet-due rows, and the plan (partial index).
4. Firing lateness p50/p99: stored delays vs native countdowns.
5. The delivery record's conditional start (one store transaction per stored-task start), p50/p99 on
   PostgreSQL and SQLite, next to the Redis ``SET NX`` delivery guard it replaced.
6. On RabbitMQ (a vhost of its own on the local server), in the same run: the sweeper (publisher
   confirms) next to raw kombu and Celery ``send_task``, and the firing lateness, as 2 and 4 measure
   them on Redis. Skipped, with the reason in the results, when no RabbitMQ answers.

Needs the local Redis and PostgreSQL the test suite uses (``SAFE_TIME_TEST_REDIS_URL``,
``SAFE_TIME_TEST_DATABASE_URL``); claims its own Redis db and creates and drops its own database.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery
from kombu import Connection, Producer

from celery_safe_time import constants as C
from celery_safe_time.config import reset_config
from celery_safe_time.delays.backends import get_store, reset_store
from celery_safe_time.delays.backends.base import NewDelay
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.payload import encode
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.exceptions import StoreError
from tests.apps.delays_tasks import define_tasks
from tests.helpers import services
from tests.helpers.processes import CeleryProcess, wait_for

logger = logging.getLogger(__name__)

APP = "tests.apps.delays_app"

SIZES = {
    False: {"memory": 20_000, "sweep": 100_000, "claim_bg": 1_000_000, "lateness": 3_000, "window": 20.0},
    # quick (make bench-quick, CI): a smoke run that every phase still runs end to end, not a measurement
    True: {"memory": 500, "sweep": 2_000, "claim_bg": 20_000, "lateness": 200, "window": 5.0},
}
#: Burst (rows due at one instant, seconds of lead before it), bulk scheduling (calls), big table (rows:
#: the purge's ten 1,000-row batches need 80,000, a sixth of the finished three quarters).
BURST = {False: (100_000, 60.0), True: (1_000, 5.0)}
AMQP_BURST = {False: 20_000, True: 500}
BULK = {False: 20_000, True: 500}
BIG_TABLE = {False: 10_000_000, True: 100_000}
#: Rows swept on RabbitMQ (full / quick): every message stays queued until the purge, and the server is
#: shared with other sessions, so fewer than on Redis (a rate, not a total, is what is measured).
AMQP_SWEEP = {False: 20_000, True: 500}
#: Conditional starts timed per store (full / quick).
STARTS = {False: 3_000, True: 100}


# --- environment -------------------------------------------------------------


class Env:
    """A claimed Redis db and a fresh PostgreSQL database for this run."""

    def __init__(self) -> None:
        self.redis_claim = services.RedisDbClaim(services.resolve_redis_base())
        self.redis_url = self.redis_claim.url
        self.pg = services.PostgresDatabase(services.resolve_postgres_admin_url())
        self.store_url = self.pg.url.replace("postgresql://", "postgresql+psycopg://", 1)
        self.redis = redis.Redis.from_url(self.redis_url)
        self.redis.flushdb()
        self.tmp = Path(tempfile.mkdtemp(prefix="safe-time-bench-"))
        self.procs: list[CeleryProcess] = []
        self.vhost: services.RabbitVhost | None = None
        #: Why the RabbitMQ rows were not measured (no server, no rabbitmqctl), or "".
        self.amqp_missing = ""
        try:
            self.vhost = services.RabbitVhost(services.resolve_amqp_base()).create()
        except BaseException as exc:  # services.unavailable() raises pytest's skip/fail outcomes
            self.amqp_missing = str(exc) or exc.__class__.__name__

    @property
    def amqp_url(self) -> str | None:
        return self.vhost.url if self.vhost is not None else None

    def conf(self, broker: str | None = None, **extra: Any) -> dict[str, Any]:
        broker_conf = {"safe_time_redis_url": self.redis_url} if broker and broker != self.redis_url else {}
        return {
            **broker_conf,
            "broker_url": broker or self.redis_url,
            "result_backend": None,
            "safe_time_store_url": self.store_url,
            # The benchmark's own apps and its worker/sweeper subprocesses are one deployment.
            "safe_time_store_namespace": "bench",
            "broker_connection_retry_on_startup": True,
            "task_ignore_result": True,
            "timezone": "UTC",
            **extra,
        }

    def app(self, broker: str | None = None, **extra: Any) -> Celery:
        app = Celery("bench", set_as_current=False)
        app.conf.update(self.conf(broker, **extra))
        define_tasks(app)
        return app

    def spawn(self, name: str, args: list[str], conf: dict[str, Any]) -> CeleryProcess:
        env = {
            "SAFE_TIME_TEST_BROKER_URL": conf.get("broker_url") or self.redis_url,
            "SAFE_TIME_TEST_RECORD_URL": self.redis_url,  # runs are recorded in Redis whatever the broker
            "SAFE_TIME_TEST_STORE_URL": self.store_url,
            "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
        }
        proc = CeleryProcess(APP, args, env, self.tmp, name).start()
        self.procs.append(proc)
        return proc

    def worker(self, name: str, conf: dict[str, Any], concurrency: int = 1) -> CeleryProcess:
        args = ["worker", "-l", "WARNING", "-n", f"{name}@%h", "-c", str(concurrency), "-P", "prefork"]
        args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        proc = self.spawn(name, args, conf)
        wait_for(lambda: self._ready(proc), timeout=90, message=f"{name} ready")
        return proc

    def _ready(self, proc: CeleryProcess, queue: str = "celery") -> bool:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        # -l WARNING hides "ready": a pool child existing means the worker is up.
        if len(_children(proc.pid)) < 1:
            return False
        broker = json.loads(proc.env["SAFE_TIME_TEST_APP_CONF"]).get("broker_url") or self.redis_url
        if broker == self.redis_url:
            return self.redis.exists("_kombu.binding.celery") == 1
        if broker.startswith("sqs://"):
            return True  # SQS keeps what is published before the worker polls: a pool child is enough
        return self.consumers(queue) >= 1

    def consumers(self, queue: str) -> int:
        """Consumers of ``queue`` in this run's RabbitMQ vhost (0 while it does not exist)."""
        assert self.vhost is not None
        out = services.subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "-p", self.vhost.name, "name", "consumers"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return sum(int(line.split()[1]) for line in out.splitlines() if line.split()[:1] == [queue])

    def purge(self, broker: str, queue: str = "celery") -> None:
        """Drop what a measurement left in ``queue``."""
        if broker == self.redis_url:
            self.redis.delete(queue)
            return
        with Connection(broker) as conn:
            conn.SimpleQueue(queue).clear()

    def store(self) -> SQLAlchemyStore:
        store = SQLAlchemyStore(self.store_url)
        store.ensure_schema()
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"TRUNCATE {C.DELAY_TABLE}"))
        return store

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        if self.vhost is not None:
            self.vhost.delete()
        self.redis.flushdb()
        self.redis.close()
        self.redis_claim.release()
        self.pg.drop()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found + [g for c in list(found) for g in _children(c)]


def tree_rss(pid: int) -> int:
    """RSS in bytes of ``pid`` and all its descendants."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


# --- 1. worker memory ------------------------------------------------------------


def bench_memory(env: Env, n: int) -> dict[str, Any]:
    conf = env.conf()
    worker = env.worker("mem", conf)
    app = env.app()
    time.sleep(2)
    base = tree_rss(worker.pid)

    # Single-threaded call rate on a sample, then the rest from 8 threads (the store is round-trip bound).
    sample = min(1000, n)
    started = time.perf_counter()
    for i in range(sample):
        app.tasks["tests.delays.record"].apply_async((f"s{i}",), countdown=7200)
    safe_send = (time.perf_counter() - started) / sample * n
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: app.tasks["tests.delays.record"].apply_async((f"s{i}",), countdown=7200), range(sample, n)
            )
        )
    time.sleep(3)
    after_safe = tree_rss(worker.pid)

    started = time.perf_counter()
    for i in range(sample):
        app.tasks["tests.delays.plain_record"].apply_async((f"p{i}",), countdown=7200)
    plain_send = (time.perf_counter() - started) / sample * n
    with app.producer_or_acquire() as producer:
        for i in range(sample, n):
            app.tasks["tests.delays.plain_record"].apply_async((f"p{i}",), countdown=7200, producer=producer)
    wait_for(lambda: env.redis.hlen("unacked") >= n, timeout=300, interval=0.5, message="worker holds all etas")
    time.sleep(3)
    after_plain = tree_rss(worker.pid)
    worker.kill()

    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    with store.engine.connect() as conn:
        size = conn.execute(sa.text("SELECT pg_total_relation_size(:t)"), {"t": C.DELAY_TABLE}).scalar_one()
        rows = conn.execute(sa.text(f"SELECT count(*) FROM {C.DELAY_TABLE} WHERE status = 'pending'")).scalar_one()
    reset_store(app)
    env.redis.flushdb()
    return {
        "n": n,
        "plain_growth_mb": (after_plain - after_safe) / 2**20,
        "safe_growth_mb": (after_safe - base) / 2**20,
        "store_bytes_per_row": size / max(rows, 1),
        "safe_send_per_s": n / safe_send,
        "plain_send_per_s": n / plain_send,
    }


# --- 2. sweeper throughput ----------------------------------------------------------


def _seed_due(env: Env, n: int) -> SQLAlchemyStore:
    store = env.store()
    encoded = encode({"args": ["x"], "kwargs": {}, "options": {}}, "json", allow_pickle=False)
    due = store.now() - timedelta(seconds=1)
    store.bulk_insert(
        [
            NewDelay(f"row-{i:07d}", "tests.delays.record", encoded.payload, encoded.content_type, "utf-8", due)
            for i in range(n)
        ]
    )
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"ANALYZE {C.DELAY_TABLE}"))
    return store


def _sweeper_child(conf: dict[str, Any], go: Any, results: Any) -> None:
    app = Celery("bench-sweeper", set_as_current=False)
    app.conf.update(conf)
    define_tasks(app)
    get_store(app).ping()
    with app.connection_for_write() as conn:
        conn.ensure_connection()
    go.wait()
    started = time.time()
    stats = sweep(app)
    results.put((stats.sent, started, time.time()))


def _raw_publish(
    env: Env,
    app: Celery,
    n: int,
    broker: str | None = None,
    confirms: bool = False,
    build: bool = False,
    confirm_each: bool = False,
) -> float:
    """Raw kombu publish rate of the same task messages (built beforehand, only publish timed).

    ``confirms``: on RabbitMQ, in confirm mode with the acks collected after the batch, as the sweep does.
    ``confirm_each``: on RabbitMQ, kombu's own ``confirm_publish``: each publish waits for its ack, what
    a per-message publisher that must know its message is taken gets (as a Redis LPUSH waits for its reply).
    ``build``: Celery's message build (``create_task_message``, with the eta) timed too, per message.
    """
    broker = broker or env.redis_url
    due = _utc(time.time())

    def message(i: int) -> Any:
        return app.amqp.create_task_message(f"raw-{i}", "tests.delays.record", ("x",), {}, eta=due if build else None)

    messages = [] if build else [message(i) for i in range(n)]
    with Connection(broker, transport_options={"confirm_publish": True} if confirm_each else {}) as conn:
        channel = conn.default_channel
        acked = [0]
        if confirms:
            channel.confirm_select()
            channel.events["basic_ack"].add(lambda tag, multiple: acked.__setitem__(0, max(acked[0], tag)))
        producer = Producer(channel)
        producer.declare()
        if broker != env.redis_url:
            conn.SimpleQueue("celery").close()  # declared and bound, as a worker would have it
        started = time.perf_counter()
        for headers, properties, body, _ in messages or (message(i) for i in range(n)):
            producer.publish(
                body, routing_key="celery", headers=headers, serializer="json", delivery_mode=2, **properties
            )
        while confirms and acked[0] < n:
            conn.drain_events(timeout=30)
        rate = n / (time.perf_counter() - started)
    env.purge(broker)
    return rate


def _send_task_rate(env: Env, app: Celery, n: int, broker: str | None = None) -> float:
    """Celery's own ``send_task`` of the same messages with eta: the sweep's per-row floor."""
    due = _utc(time.time())
    with app.producer_or_acquire() as producer:
        started = time.perf_counter()
        for i in range(n):
            app.send_task("tests.delays.record", ("x",), {}, task_id=f"st-{i}", eta=due, producer=producer)
        rate = n / (time.perf_counter() - started)
    env.purge(broker or env.redis_url)
    return rate


def bench_sweep(env: Env, n: int) -> dict[str, Any]:
    conf = env.conf(safe_time_sweep_batch=500)
    out: dict[str, Any] = {"rows": n}

    app = env.app(safe_time_sweep_batch=500)
    # a rate, not a total: 10,000 messages measure it as well as 100,000 and keep `make bench` short
    probe = min(n, 10_000)
    out["baseline_messages"] = probe
    raw = [_raw_publish(env, app, probe)]
    out["celery_send_task_per_s"] = _send_task_rate(env, app, probe)
    store = _seed_due(env, n)
    started = time.perf_counter()
    stats = sweep(app)
    out["sweep_1_per_s"] = stats.sent / (time.perf_counter() - started)
    assert stats.sent == n, stats
    env.redis.delete("celery")
    reset_store(app)
    raw.append(_raw_publish(env, app, probe))

    store = _seed_due(env, n)
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_sweeper_child, args=(conf, go, results)) for _ in range(4)]
    for p in procs:
        p.start()
    time.sleep(4)  # let them import and connect before the clock starts
    go.set()
    parts = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    sent = sum(p[0] for p in parts)
    out["sweep_4_per_s"] = sent / (max(p[2] for p in parts) - min(p[1] for p in parts))
    published = env.redis.llen("celery")
    assert sent == n == published, (sent, n, published)
    out["sweep_4_split"] = sorted(p[0] for p in parts)
    env.redis.delete("celery")
    # The machine is shared: the baseline is the mean of runs taken right before each sweep run.
    out["raw_kombu_runs"] = raw
    out["raw_kombu_per_s"] = statistics.mean(raw)
    store.close()
    return out


def bench_sweep_amqp(env: Env, n: int) -> dict[str, Any]:
    """One sweeper on RabbitMQ (publisher confirms, rows marked sent only when acked) next to raw kombu
    with and without confirms and Celery's ``send_task``, in the same vhost and run."""
    url = env.amqp_url
    if url is None:
        return {"missing": env.amqp_missing}
    app = env.app(url, safe_time_sweep_batch=500)
    # A round trip per message: a rate, and a few thousand measure it (20,000 would add a minute).
    each = min(n, 3_000)
    out: dict[str, Any] = {"rows": n, "baseline_messages": n, "confirm_each_messages": each}
    raw = [_raw_publish(env, app, n, url)]
    raw_each = [_raw_publish(env, app, each, url, confirm_each=True)]
    raw_confirmed = [_raw_publish(env, app, n, url, confirms=True)]
    built = [_raw_publish(env, app, n, url, confirms=True, build=True)]
    out["celery_send_task_per_s"] = _send_task_rate(env, app, n, url)
    store = _seed_due(env, n)
    started = time.perf_counter()
    stats = sweep(app)
    out["sweep_1_per_s"] = stats.sent / (time.perf_counter() - started)
    assert stats.sent == n, stats
    env.purge(url)
    reset_store(app)
    raw.append(_raw_publish(env, app, n, url))
    raw_each.append(_raw_publish(env, app, each, url, confirm_each=True))
    raw_confirmed.append(_raw_publish(env, app, n, url, confirms=True))
    built.append(_raw_publish(env, app, n, url, confirms=True, build=True))
    # Celery's message build alone, the same messages: a ceiling for any publisher of Celery messages.
    started = time.perf_counter()
    for i in range(n):
        app.amqp.create_task_message(f"b-{i}", "tests.delays.record", ("x",), {}, eta=_utc(time.time()))
    out["celery_build_per_s"] = n / (time.perf_counter() - started)
    out["raw_kombu_runs"] = raw
    out["raw_kombu_per_s"] = statistics.mean(raw)
    out["raw_kombu_confirmed_per_s"] = statistics.mean(raw_confirmed)
    #: The goal's baseline: kombu's per-message publish with confirm_publish (each waits for its ack).
    out["raw_kombu_confirm_each_runs"] = raw_each
    out["raw_kombu_confirm_each_per_s"] = statistics.mean(raw_each)
    #: Built (Celery's create_task_message) and published per message with batch confirms: no store.
    out["raw_kombu_built_per_s"] = statistics.mean(built)
    store.close()
    return out


# --- 3. claim query -------------------------------------------------------------------


def _claim_ms(store: SQLAlchemyStore, repeats: int = 30) -> tuple[float, str]:
    """Median time of the claim SELECT (rolled back, so the due rows stay) and its plan."""
    timings = []
    query = store.claim_query(limit=500, horizon=store.now() + timedelta(seconds=C.SWEEP_LOOKAHEAD))
    compiled = query.compile(dialect=store.engine.dialect, compile_kwargs={"render_postcompile": True})
    with store.engine.connect() as conn:
        for _ in range(repeats):
            trans = conn.begin()
            started = time.perf_counter()
            got = conn.exec_driver_sql(str(compiled), compiled.params).all()
            timings.append((time.perf_counter() - started) * 1000)
            trans.rollback()
            assert len(got) == 500, len(got)
        plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params).all())
    return statistics.median(timings), plan


def bench_claim(env: Env, background: int) -> dict[str, Any]:
    store = env.store()
    encoded = encode({"args": ["x"], "kwargs": {}, "options": {}}, "json", allow_pickle=False)
    due = store.now() - timedelta(seconds=1)
    store.bulk_insert(
        [
            NewDelay(f"due-{i}", "tests.delays.record", encoded.payload, "application/json", "utf-8", due)
            for i in range(500)
        ]
    )
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"ANALYZE {C.DELAY_TABLE}"))
    empty_ms, _ = _claim_ms(store)
    with store.engine.begin() as conn:
        # Not yet due (tomorrow and later), plus as many already-sent rows: neither may slow the claim.
        conn.execute(
            sa.text(
                f"INSERT INTO {C.DELAY_TABLE} (id, task, payload, content_type, content_encoding, due_at, status,"
                " attempts, created_at, updated_at)"
                " SELECT 'bg-' || g, 'tests.delays.record', :payload, 'application/json', 'utf-8',"
                " now() + interval '1 day' + g * interval '1 second',"
                " CASE WHEN g % 2 = 0 THEN 'pending' ELSE 'sent' END, 0, now(), now()"
                " FROM generate_series(1, :n) AS g"
            ),
            {"payload": encoded.payload, "n": background * 2},
        )
        conn.execute(sa.text(f"ANALYZE {C.DELAY_TABLE}"))
    full_ms, plan = _claim_ms(store)
    store.close()
    return {
        "background_not_due": background,
        "background_sent": background,
        "claim_ms_empty": empty_ms,
        "claim_ms_full": full_ms,
        "uses_partial_index": C.DELAY_DUE_INDEX in plan,
        "plan": plan,
    }


# --- 4. lateness -------------------------------------------------------------------------


def _lateness(env: Env, n: int, window: float, lead: float, stored: bool, app: Celery) -> dict[str, float]:
    env.redis.delete("test:runs")
    task = app.tasks["tests.delays.record" if stored else "tests.delays.plain_record"]
    start = time.time() + lead

    def send(i: int) -> None:
        due = start + window * i / n
        task.apply_async((repr(due),), eta=_utc(due))

    with ThreadPoolExecutor(8 if stored else 1) as pool:
        list(pool.map(send, range(n)))
    if time.time() > start:
        raise RuntimeError("sending took longer than the lead time: lateness would be meaningless")
    wait_for(lambda: env.redis.llen("test:runs") >= n, timeout=lead + window + 300, interval=0.5, message="runs")
    late = sorted(
        json.loads(raw)["started"] - float(json.loads(raw)["label"]) for raw in env.redis.lrange("test:runs", 0, -1)
    )
    return {
        "p50": late[len(late) // 2],
        "p99": late[min(len(late) - 1, int(len(late) * 0.99))],
        "max": late[-1],
        "samples": [round(x, 4) for x in late],  # for the doc's CDF chart
    }


def _utc(ts: float) -> Any:
    from celery_safe_time.clock import to_datetime

    return to_datetime(ts)


def bench_lateness(env: Env, n: int, window: float, broker: str | None = None) -> dict[str, Any]:
    env.store().close()
    # The sweep runs on its own queue and worker (safe_time_sweep_queue), as docs/delays.md advises,
    # so it never waits behind, or delays, the tasks it releases.
    options = {
        "safe_time_delay_threshold": 5,
        "safe_time_sweep_interval": 1,
        "safe_time_sweep_queue": "safe_time_sweep",
    }
    conf = env.conf(broker, **options)
    worker = env.worker("late", conf, concurrency=2)
    sweeper = env.spawn(
        "late-sweeper",
        ["worker", "-l", "WARNING", "-n", "sweeper@%h", "-c", "1", "-Q", "safe_time_sweep", "--without-gossip",
         "--without-mingle", "--without-heartbeat"],
        conf,
    )  # fmt: skip
    beat_args = ["beat", "-l", "WARNING", "-S", "celery.beat:PersistentScheduler", "-s", str(env.tmp / "beat-schedule")]
    beat = env.spawn("late-beat", beat_args, conf)
    app = env.app(broker, **options)
    if broker is not None and broker != env.redis_url:
        wait_for(lambda: env._ready(sweeper, "safe_time_sweep"), timeout=90, message="the sweeper consuming")
    lead = 10.0 + n / 250.0  # time to send them all before the first is due
    stored = _lateness(env, n, window, lead, True, app)
    native = _lateness(env, n, window, lead, False, app)
    worker.kill()
    sweeper.kill()
    beat.kill()
    reset_store(app)
    reset_config(app)
    return {"n": n, "window_s": window, "stored": stored, "native": native}


def bench_lateness_amqp(env: Env, n: int, window: float) -> dict[str, Any]:
    if env.amqp_url is None:
        return {"missing": env.amqp_missing}
    return bench_lateness(env, n, window, env.amqp_url)


# --- 7. bulk scheduling ------------------------------------------------------------------------


def bench_bulk(env: Env, n: int) -> dict[str, Any]:
    """``SafeTask.apply_many`` of ``n`` long delays (one transaction) beside the broker's send rate of the
    same calls (plain countdowns, one producer) and ``delay()`` one call at a time, one thread each."""
    env.store().close()
    app = env.app()
    record, plain = app.tasks["tests.delays.record"], app.tasks["tests.delays.plain_record"]
    sample = min(n, 2000)
    started = time.perf_counter()
    for i in range(sample):
        record.apply_async((f"one-{i}",), countdown=7200)
    single = sample / (time.perf_counter() - started)
    with app.producer_or_acquire() as producer:
        started = time.perf_counter()
        for i in range(n):
            plain.apply_async((f"p{i}",), countdown=7200, producer=producer)
        broker = n / (time.perf_counter() - started)
    env.purge(env.redis_url)
    calls = [((f"many-{i}",), {}, {"countdown": 7200}) for i in range(n)]
    started = time.perf_counter()
    results = record.apply_many(calls)
    many = n / (time.perf_counter() - started)
    assert len(results) == n
    store = get_store(app)
    assert store.counts()[C.STATUS_PENDING] == n + sample
    reset_store(app)
    return {"n": n, "apply_many_per_s": many, "broker_send_per_s": broker, "single_delay_per_s": single}


# --- 8. bursts -----------------------------------------------------------------------------------


def _burst_sweeper(
    conf: dict[str, Any], lookahead: float | None, go: Any, start: Any, done: Any, results: Any, ready: Any
) -> None:
    """One sweeper process: what beat's sweep entry does, every sweep interval, until told to stop."""
    app = Celery("bench-burst", set_as_current=False)
    app.conf.update(conf)
    define_tasks(app)
    get_store(app).ping()
    with app.connection_for_write() as conn:
        conn.ensure_connection()
    ready.put(True)
    go.wait()
    # Warm up on rows already due (fixed look-ahead 0): the sweeper measures its own publish rate, as a
    # running deployment has, before the burst comes into its look-ahead.
    sweep(app, lookahead=0, max_batches=1)
    ready.put(True)
    start.wait()
    interval = float(conf["safe_time_sweep_interval"])
    lookaheads: list[float] = []
    sent = 0
    while not done.is_set():
        began = time.time()
        try:
            stats = sweep(app, lookahead=lookahead)
        except StoreError:
            continue
        sent += stats.sent
        if stats.claimed:
            lookaheads.append(round(stats.lookahead, 2))
        else:
            done.wait(max(0.0, interval - (time.time() - began)))
    results.put((sent, lookaheads[:5]))


def _burst(
    env: Env, n: int, lead: float, sweepers: int, lookahead: float | None, broker: str | None = None
) -> dict[str, Any]:
    conf = env.conf(broker, safe_time_sweep_batch=500, safe_time_sweep_interval=1)
    store = env.store()
    ctx = multiprocessing.get_context("spawn")
    go, start, done, results, ready = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_burst_sweeper, args=(conf, lookahead, go, start, done, results, ready))
        for _ in range(sweepers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)  # imported and connected: the lead time starts after this
    encoded = encode({"args": ["x"], "kwargs": {}, "options": {}}, "json", allow_pickle=False)
    now = store.now()
    later = now + timedelta(days=1)  # out of every look-ahead until the due instant is set below
    warm = [
        NewDelay(f"warm-{i:05d}", "tests.delays.record", encoded.payload, "application/json", "utf-8", now)
        for i in range(500 * sweepers)
    ]
    store.bulk_insert(warm)
    store.bulk_insert(
        [
            NewDelay(f"burst-{i:07d}", "tests.delays.record", encoded.payload, "application/json", "utf-8", later)
            for i in range(n)
        ]
    )
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"ANALYZE {C.DELAY_TABLE}"))
    go.set()
    for _ in procs:
        ready.get(timeout=300)  # warmed up: each has measured its publish rate on one batch
    with store.engine.begin() as conn:
        # The due instant counts from now, after the (slow, client-side) seeding: the lead is all theirs.
        due = conn.execute(
            sa.text(
                f"UPDATE {C.DELAY_TABLE} SET due_at = date_trunc('milliseconds', clock_timestamp())"
                " + make_interval(secs => :lead) WHERE id LIKE 'burst-%' RETURNING due_at"
            ),
            {"lead": lead},
        ).first()[0]
    # What sizing the look-ahead costs a sweep under this backlog (the one query it adds).
    started = time.perf_counter()
    store.pending_ahead(due + timedelta(seconds=1), C.DEFAULT_SWEEP_MAX_AHEAD)
    count_ms = (time.perf_counter() - started) * 1000
    start.set()
    query = sa.text(f"SELECT count(*) FROM {C.DELAY_TABLE} WHERE id LIKE 'burst-%' AND status = 'sent'")
    deadline = time.time() + lead + 600
    with store.engine.connect() as conn:
        while conn.execute(query).scalar_one() < n and time.time() < deadline:
            conn.rollback()
            time.sleep(0.5)
    done.set()
    parts = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    with store.engine.connect() as conn:
        late = conn.execute(
            sa.text(
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY s),"
                " percentile_cont(0.99) WITHIN GROUP (ORDER BY s), max(s), min(s), count(*)"
                " FROM (SELECT extract(epoch FROM sent_at - due_at) AS s"
                f" FROM {C.DELAY_TABLE} WHERE id LIKE 'burst-%' AND status = 'sent') t"
            )
        ).one()
    broker_url = broker or env.redis_url
    env.purge(broker_url)
    store.close()
    return {
        "rows": n,
        "sweepers": sweepers,
        "lead_s": lead,
        "lookahead": "fixed 2 s" if lookahead is not None else "adaptive",
        "sent": int(late[4]),
        # sent_at is stamped when the batch is marked sent, after its publish: an upper bound.
        "p50_s": float(late[0]),
        "p99_s": float(late[1]),
        "last_publish_s": float(late[2]),
        "first_publish_s": float(late[3]),
        "publish_span_s": float(late[2]) - float(late[3]),
        "split": sorted(p[0] for p in parts),
        "lookaheads_s": [p[1] for p in parts],
        "pending_ahead_ms": round(count_ms, 1),
    }


def bench_burst(env: Env, n: int, lead: float) -> dict[str, Any]:
    """``n`` rows due at one instant ``lead`` s from now: when are they published, relative to it?

    Sweeper processes sweep every second (beat's entry), PostgreSQL store, Redis broker. Baseline, same
    run: one sweeper with the fixed 2 s look-ahead (the sweep before the adaptive one)."""
    return {
        "fixed_1": _burst(env, n, 5.0, 1, C.SWEEP_LOOKAHEAD),
        "adaptive_1": _burst(env, n, lead, 1, None),
        "adaptive_4": _burst(env, n, lead, 4, None),
    }


def bench_burst_amqp(env: Env, n: int, lead: float) -> dict[str, Any]:
    if env.amqp_url is None:
        return {"missing": env.amqp_missing}
    return {
        "fixed_1": _burst(env, n, 5.0, 1, C.SWEEP_LOOKAHEAD, env.amqp_url),
        "adaptive_1": _burst(env, n, lead, 1, None, env.amqp_url),
    }


# --- 9. big tables -----------------------------------------------------------------------------------


def _sweep_rate(env: Env, app: Celery, store: SQLAlchemyStore, n: int, prefix: str) -> float:
    encoded = encode({"args": ["x"], "kwargs": {}, "options": {}}, "json", allow_pickle=False)
    due = store.now() - timedelta(seconds=1)
    store.bulk_insert(
        [
            NewDelay(f"{prefix}-{i:06d}", "tests.delays.record", encoded.payload, "application/json", "utf-8", due)
            for i in range(n)
        ]
    )
    started = time.perf_counter()
    stats = sweep(app, lookahead=C.SWEEP_LOOKAHEAD)
    rate = stats.sent / (time.perf_counter() - started)
    assert stats.sent == n, stats
    env.purge(env.redis_url)
    return rate


def bench_big_table(env: Env, total: int) -> dict[str, Any]:
    """The claim query and a sweep with ``total`` rows in the table (finished and pending, made server-side
    with generate_series) beside the same on an empty table; then the purge with its index."""
    store = env.store()
    app = env.app(safe_time_sweep_batch=500)
    set_store_for(app, store)
    out: dict[str, Any] = {"rows": total}
    out["sweep_empty_per_s"] = _sweep_rate(env, app, store, 5000, "empty")
    store.bulk_insert(
        [
            NewDelay(f"due-{i}", "tests.delays.record", b"{}", "application/json", "utf-8", store.now())
            for i in range(500)
        ]
    )
    out["claim_ms_empty"], _ = _claim_ms(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {C.DELAY_TABLE}"))
    began = time.time()
    with store.engine.begin() as conn:
        # Three in four rows finished (sent, finished, cancelled) over the last 30 days, one in four
        # pending, due later.
        conn.execute(
            sa.text(
                f"INSERT INTO {C.DELAY_TABLE} (id, task, payload, content_type, content_encoding, due_at, status,"
                " attempts, created_at, updated_at, starts)"
                " SELECT 'big-' || g, 'tests.delays.record', '\\x7b7d'::bytea, 'application/json', 'utf-8',"
                " CASE WHEN g % 4 = 0 THEN now() + interval '1 day' + g * interval '1 millisecond'"
                "      ELSE now() - interval '30 days' + g * interval '1 millisecond' END,"
                " (ARRAY['pending', 'sent', 'finished', 'cancelled'])[g % 4 + 1], 1,"
                " now() - interval '30 days', now() - (g::float8 / :n) * interval '30 days', 0"
                " FROM generate_series(1, :n) AS g"
            ),
            {"n": total},
        )
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM ANALYZE {C.DELAY_TABLE}"))
        # The fill wrote gigabytes of WAL in seconds; without a checkpoint here its flush would land on
        # the measurement (a table that grew over months has no such backlog).
        conn.execute(sa.text("CHECKPOINT"))
        out["table_mb"] = (
            conn.execute(sa.text("SELECT pg_total_relation_size(:t)"), {"t": C.DELAY_TABLE}).scalar_one() / 2**20
        )
    out["fill_s"] = round(time.time() - began, 1)
    store.bulk_insert(
        [
            NewDelay(f"due-{i}", "tests.delays.record", b"{}", "application/json", "utf-8", store.now())
            for i in range(500)
        ]
    )
    out["claim_ms_full"], out["plan"] = _claim_ms(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {C.DELAY_TABLE} WHERE id LIKE 'due-%'"))
    out["sweep_full_per_s"] = _sweep_rate(env, app, store, 5000, "full")
    # The purge: 1,000-row batches of the oldest finished rows (last changed over 25 of the 30 days ago:
    # a sixth of them), through cst_delay_updated.
    before = store.now() - timedelta(days=25)
    timings = []
    for _ in range(10):
        started = time.perf_counter()
        assert store.purge(before, C.PURGE_DEFAULT_STATUSES, C.PURGE_BATCH) == C.PURGE_BATCH
        timings.append((time.perf_counter() - started) * 1000)
    out["purge_batch_ms"] = statistics.median(timings)
    with store.engine.connect() as conn:
        plan = conn.execute(
            sa.text(
                f"EXPLAIN SELECT id FROM {C.DELAY_TABLE} WHERE status IN ('cancelled', 'expired', 'finished', 'sent')"
                " AND updated_at < :before LIMIT 1000"
            ),
            {"before": before},
        ).all()
    out["purge_uses_index"] = C.DELAY_UPDATED_INDEX in "\n".join(r[0] for r in plan)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {C.DELAY_TABLE}"))
    reset_store(app)
    store.close()
    return out


def set_store_for(app: Celery, store: SQLAlchemyStore) -> None:
    from celery_safe_time.delays.backends import set_store

    set_store(app, store)


# --- entry points ----------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _time_starts(store: SQLAlchemyStore, n: int, prefix: str) -> list[float]:
    """Milliseconds per conditional start of ``n`` claimed rows, one call at a time."""
    now = store.now()
    ids = [f"{prefix}-{i:06d}" for i in range(n)]
    payload = json.dumps({"args": [], "kwargs": {}, "options": {}}).encode()
    store.bulk_insert(
        [NewDelay(i, "tests.delays.record", payload, "application/json", "utf-8", due_at=now) for i in ids]
    )
    rows = store.claim_due(limit=n, lookahead=1, token="bench")
    took: list[float] = []
    for row in rows:
        started = time.perf_counter()
        verdict = store.start(row.id, row.delivery_token or "", "run", "bench-host", stale_after=60).verdict
        took.append((time.perf_counter() - started) * 1000)
        assert verdict == "run", verdict
    return took


def bench_start(env: Env, n: int) -> dict[str, Any]:
    """The delivery record's conditional start vs the Redis delivery guard (SET NX EX) it replaced."""
    results: dict[str, Any] = {"n": n}
    pg = env.store()
    sqlite = SQLAlchemyStore(f"sqlite:///{env.tmp / 'start.sqlite3'}")
    sqlite.ensure_schema()
    for name, store in (("postgresql", pg), ("sqlite", sqlite)):
        _time_starts(store, 50, "warm")  # warm the pool and the statement cache
        took = _time_starts(store, n, "start")
        results[name] = {"p50_ms": round(_pct(took, 50), 3), "p99_ms": round(_pct(took, 99), 3)}
        store.close()
    client = redis.Redis.from_url(env.redis_url)
    took = []
    for i in range(n + 50):
        started = time.perf_counter()
        client.set(f"bench:done:{i}:0", "bench-host", nx=True, ex=C.FIRED_SLOT_TTL)
        if i >= 50:
            took.append((time.perf_counter() - started) * 1000)
    client.close()
    results["redis_guard"] = {"p50_ms": round(_pct(took, 50), 3), "p99_ms": round(_pct(took, 99), 3)}
    return results


def run(quick: bool) -> dict[str, Any]:
    sizes = SIZES[quick]
    env = Env()
    try:
        results: dict[str, Any] = {"quick": quick, "phase_seconds": {}}
        phases: list[tuple[str, Any]] = [
            ("memory", lambda: bench_memory(env, int(sizes["memory"]))),
            ("sweep", lambda: bench_sweep(env, int(sizes["sweep"]))),
            ("claim", lambda: bench_claim(env, int(sizes["claim_bg"]))),
            ("lateness", lambda: bench_lateness(env, int(sizes["lateness"]), float(sizes["window"]))),
            ("start", lambda: bench_start(env, STARTS[quick])),
            ("sweep_amqp", lambda: bench_sweep_amqp(env, AMQP_SWEEP[quick])),
            ("bulk", lambda: bench_bulk(env, BULK[quick])),
            ("burst", lambda: bench_burst(env, *BURST[quick])),
            ("burst_amqp", lambda: bench_burst_amqp(env, AMQP_BURST[quick], BURST[quick][1])),
            ("big_table", lambda: bench_big_table(env, BIG_TABLE[quick])),
            ("lateness_amqp", lambda: bench_lateness_amqp(env, int(sizes["lateness"]), float(sizes["window"]))),
        ]
        for name, phase in phases:
            started = time.time()
            try:
                results[name] = phase()
            except Exception as exc:  # one broken phase must not take the others' numbers with it
                logger.exception("delays phase %s failed", name)
                results.setdefault("failed_phases", {})[name] = f"{exc.__class__.__name__}: {exc}"
            results["phase_seconds"][name] = round(time.time() - started, 1)  # where `make bench` spends its time
        return results
    finally:
        env.close()


def table(results: dict[str, Any]) -> str:
    m, s, c, lt = results["memory"], results["sweep"], results["claim"], results["lateness"]
    rows = [
        ("| measurement | celery-safe-time | baseline | ratio |", None),
        ("|---|---|---|---|", None),
        (
            f"| worker RSS growth, {m['n']:,} pending 2 h countdowns | {m['safe_growth_mb']:.1f} MB (SafeTask) "
            f"| {m['plain_growth_mb']:.1f} MB (plain Celery) | {_ratio(m['safe_growth_mb'], m['plain_growth_mb'])} |",
            None,
        ),
        (f"| store bytes per pending row (table + indexes) | {m['store_bytes_per_row']:.0f} B | - | - |", None),
        (
            f"| send rate, {m['n']:,} delayed calls | {m['safe_send_per_s']:.0f}/s (row insert) "
            f"| {m['plain_send_per_s']:.0f}/s (broker) | {_ratio(m['safe_send_per_s'], m['plain_send_per_s'])} |",
            None,
        ),
        (
            f"| sweep, 1 sweeper, {s['rows']:,} due rows (PostgreSQL) | {s['sweep_1_per_s']:.0f} rows/s "
            f"| {s['raw_kombu_per_s']:.0f} msg/s (raw kombu publish) "
            f"| {_ratio(s['sweep_1_per_s'], s['raw_kombu_per_s'])} |",
            None,
        ),
        (
            f"| (context) Celery send_task of the same messages, 1 process | {s['celery_send_task_per_s']:.0f} msg/s "
            f"| {s['raw_kombu_per_s']:.0f} msg/s | {_ratio(s['celery_send_task_per_s'], s['raw_kombu_per_s'])} |",
            None,
        ),
        (
            f"| sweep, 4 sweepers (split {s['sweep_4_split']}) | {s['sweep_4_per_s']:.0f} rows/s "
            f"| {s['raw_kombu_per_s']:.0f} msg/s | {_ratio(s['sweep_4_per_s'], s['raw_kombu_per_s'])} |",
            None,
        ),
        (
            f"| claim query (500 due rows), {c['background_not_due']:,} not-yet-due + {c['background_sent']:,} sent "
            f"rows | {c['claim_ms_full']:.2f} ms | {c['claim_ms_empty']:.2f} ms (no other rows) "
            f"| {_ratio(c['claim_ms_full'], c['claim_ms_empty'])} |",
            None,
        ),
        (f"| claim plan uses partial index `{C.DELAY_DUE_INDEX}` | {c['uses_partial_index']} | - | - |", None),
        (
            f"| firing lateness p50 / p99, {lt['n']:,} delays over {lt['window_s']:.0f} s "
            f"| {lt['stored']['p50'] * 1000:.0f} / {lt['stored']['p99'] * 1000:.0f} ms (stored) "
            f"| {lt['native']['p50'] * 1000:.0f} / {lt['native']['p99'] * 1000:.0f} ms (native countdown) | - |",
            None,
        ),
    ]
    st = results.get("start")
    if st:
        guard = st["redis_guard"]
        for name in ("postgresql", "sqlite"):
            rows.append(
                (
                    f"| delivery record: conditional start, {st['n']:,} starts ({name}) p50 / p99 "
                    f"| {st[name]['p50_ms']:.2f} / {st[name]['p99_ms']:.2f} ms "
                    f"| {guard['p50_ms']:.2f} / {guard['p99_ms']:.2f} ms (Redis SET NX guard it replaced) "
                    f"| {_ratio(st[name]['p50_ms'], guard['p50_ms'])} |",
                    None,
                )
            )
    sa_, la = results.get("sweep_amqp"), results.get("lateness_amqp")
    if sa_ and "missing" in sa_:
        rows.append((f"| RabbitMQ rows | not run: {sa_['missing']} | - | - |", None))
    elif sa_:
        rows.append(
            (
                f"| sweep on RabbitMQ (publisher confirms), 1 sweeper, {sa_['rows']:,} due rows "
                f"| {sa_['sweep_1_per_s']:.0f} rows/s | {sa_['raw_kombu_per_s']:.0f} msg/s (raw kombu, no confirms; "
                f"{sa_['raw_kombu_confirmed_per_s']:.0f}/s with batch confirms; Celery send_task "
                f"{sa_['celery_send_task_per_s']:.0f}/s) | {_ratio(sa_['sweep_1_per_s'], sa_['raw_kombu_per_s'])} |",
                None,
            )
        )
        if "raw_kombu_confirm_each_per_s" in sa_:
            rows.append(
                (
                    "| (goal) the same sweep vs kombu's per-message publish with `confirm_publish` (each publish "
                    f"waits for its ack), {sa_['confirm_each_messages']:,} messages "
                    f"| {sa_['sweep_1_per_s']:.0f} rows/s | {sa_['raw_kombu_confirm_each_per_s']:.0f} msg/s "
                    f"| {_ratio(sa_['sweep_1_per_s'], sa_['raw_kombu_confirm_each_per_s'])} |",
                    None,
                )
            )
        if "raw_kombu_built_per_s" in sa_:
            rows.append(
                (
                    f"| (context) the same sweep vs messages built by Celery and published raw, batch confirms "
                    f"| {sa_['sweep_1_per_s']:.0f} rows/s | {sa_['raw_kombu_built_per_s']:.0f} msg/s "
                    f"(Celery's message build alone: {sa_['celery_build_per_s']:.0f}/s) "
                    f"| {_ratio(sa_['sweep_1_per_s'], sa_['raw_kombu_built_per_s'])} |",
                    None,
                )
            )
    if la and "missing" not in la:
        rows.append(
            (
                f"| firing lateness p50 / p99 on RabbitMQ, {la['n']:,} delays over {la['window_s']:.0f} s "
                f"| {la['stored']['p50'] * 1000:.0f} / {la['stored']['p99'] * 1000:.0f} ms (stored) "
                f"| {la['native']['p50'] * 1000:.0f} / {la['native']['p99'] * 1000:.0f} ms (native countdown) | - |",
                None,
            )
        )
    bu = results.get("bulk")
    if bu:
        rows.append(
            (
                f"| bulk scheduling: `apply_many` of {bu['n']:,} long delays (one transaction) "
                f"| {bu['apply_many_per_s']:.0f} calls/s | {bu['broker_send_per_s']:.0f}/s (broker send, plain "
                f"countdowns); `delay()` one by one {bu['single_delay_per_s']:.0f}/s "
                f"| {_ratio(bu['apply_many_per_s'], bu['broker_send_per_s'])} |",
                None,
            )
        )
    for key, broker in (("burst", "Redis"), ("burst_amqp", "RabbitMQ")):
        b = results.get(key)
        if not b or "missing" in b:
            continue
        for case in ("fixed_1", "adaptive_1", "adaptive_4"):
            r = b.get(case)
            if not r:
                continue
            rows.append(
                (
                    f"| burst on {broker}: {r['rows']:,} rows due at one instant, {r['sweepers']} sweeper(s), "
                    f"{r['lookahead']} look-ahead: last publish / p50 / p99 vs the due instant "
                    f"| {r['last_publish_s']:+.2f} / {r['p50_s']:+.2f} / {r['p99_s']:+.2f} s "
                    f"(split {r['split']}, look-aheads {r['lookaheads_s']}) | goal: last <= +1 s | - |",
                    None,
                )
            )
    bt = results.get("big_table")
    if bt:
        rows.append(
            (
                f"| claim query with {bt['rows']:,} rows in the table ({bt['table_mb']:.0f} MB, 3/4 finished) "
                f"| {bt['claim_ms_full']:.2f} ms | {bt['claim_ms_empty']:.2f} ms (empty table) "
                f"| {_ratio(bt['claim_ms_full'], bt['claim_ms_empty'])} |",
                None,
            )
        )
        rows.append(
            (
                f"| sweep of 5,000 due rows with {bt['rows']:,} rows in the table "
                f"| {bt['sweep_full_per_s']:.0f} rows/s "
                f"| {bt['sweep_empty_per_s']:.0f} rows/s (empty table) "
                f"| {_ratio(bt['sweep_empty_per_s'], bt['sweep_full_per_s'])} (time) |",
                None,
            )
        )
        rows.append(
            (
                f"| purge batch (1,000 oldest finished rows) in that table | {bt['purge_batch_ms']:.1f} ms "
                f"(index `{C.DELAY_UPDATED_INDEX}` used: {bt['purge_uses_index']}) | - | - |",
                None,
            )
        )
    return "\n".join(r for r, _ in rows) + "\n\nClaim plan:\n```\n" + c["plan"] + "\n```\n"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}x" if base else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (under 2 minutes)")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = parser.parse_args(argv)
    started = time.time()
    results = run(args.quick)
    print(table(results))
    print(f"(took {time.time() - started:.0f} s)")
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
