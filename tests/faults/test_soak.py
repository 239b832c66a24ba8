"""One combined fault scenario with real processes: 3 beats, 2 workers, a sweeper, stored delays,
periodic entries, locked and idempotent tasks, gates stacked as users stack them (``overlap_lock`` and
``concurrency_limit(limit=2)`` above ``rate_limit``, a ``buffer_all`` entry whose task has a
``rate_limit``), while a seeded RNG kills (-9), pauses
(SIGSTOP/SIGCONT) and restarts them, restarts and flushes the lease/lock Redis, cuts PostgreSQL
off (through a TCP proxy) and runs one beat, one worker and the sweeper with a local clock 5
minutes off. At the end the invariants are checked and the counts printed as a table.

Short by default (part of ``make test``); ``SAFE_TIME_SOAK=1`` scales it to the soak sizes
(10,000 delays, 1,000 locked tasks, 10 minutes). ``SAFE_TIME_SOAK_SEED=<n>`` replays a run.

It runs once per broker: Redis, and RabbitMQ (a vhost of its own; the lease/lock Redis and the
record Redis stay Redis). A third run puts the coordination in PostgreSQL
(``safe_time_coordination_url = "store"``) with RabbitMQ as the broker and no Redis at all: no result
backend, runs recorded in append-only files, and a watch on ``/proc`` that no process of the run is
or talks to a Redis. Every run has a PostgreSQL server of its own that the faults stop and start
(``pg_ctl stop -m fast`` and ``-m immediate``, a crash), so the three runs go beside other tests.
In the run with no Redis nothing is "admitted": every repeat of a slot, key or lock fails the test.

Every task is ``acks_late``: a worker killed mid-run has its messages redelivered, and a stored
delay killed mid-body runs again (at least once) after its heartbeat is found dead, never beside
itself.

Stored delays admit nothing: the delivery record lives in PostgreSQL, so every due delay must run to
its end exactly once (plus re-runs of runs killed mid-body, counted apart). Where the design admits
a broken invariant it is counted apart, never hidden: the lease/lock Redis runs without persistence,
so a restart or FLUSHALL forgets fired-slot markers, idempotency markers and held locks. A second run
of the same slot / key is "admitted" only when such a reset happened between the two runs (or, for a
lock overlap, during it); any other repeat fails the test.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery

from celery_safe_time import SafeTask, install
from celery_safe_time import constants as C
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.exceptions import StoreError
from celery_safe_time.locks.backends import get_lock_backend
from tests.faults.proxy import TcpProxy, proxy_for
from tests.helpers import services
from tests.helpers.processes import CeleryProcess, ProcessManager, managed_processes, wait_for
from tests.helpers.services import PostgresServer, RedisServer, RedisWatch

pytestmark = [pytest.mark.integration, pytest.mark.soak]

SOAK = bool(os.environ.get("SAFE_TIME_SOAK"))
#: Stored delays whose first run gives its message back (tests/apps/faults_app.py BODY_FAULTS): in the
#: soak, or with SAFE_TIME_SOAK_BODY_FAULTS=1 in the short run.
BODY_FAULTS = SOAK or bool(os.environ.get("SAFE_TIME_SOAK_BODY_FAULTS"))
FAULTS_APP = "tests.apps.faults_app"
LEASE = 6.0
LOCK_TTL = 6.0
VISIBILITY = 15
SKEW = 300
DELIVERY_GRACE = 8
#: A run may start this much before its due time / slot (clock reads across processes).
EARLY_TOLERANCE = 1.0


@dataclass(frozen=True)
class Sizes:
    fault_phase: float  # seconds of faults and load
    delays: int
    far_delays: int  # due in a day: must still be pending at the end
    countdown: tuple[float, float]
    locked: int
    lock_keys: int
    idem_keys: int
    pg_outage: tuple[float, float]
    #: seconds the drain may go on without one more call or row ending: a backlog still shrinking is
    #: late, not lost; one that stops shrinking is stuck
    drain: float
    #: seconds the drain may take at most, shrinking or not
    drain_cap: float
    #: seconds the store's proxy stops forwarding on every open connection (new ones pass)
    pg_stall: tuple[float, float] = (1.5, 3.5)
    #: calls of each stacked task (tests/apps/faults_app.py), sent in bursts of one key
    stacked_calls: int = 36


SHORT = Sizes(
    fault_phase=60,
    delays=300,
    far_delays=20,
    countdown=(6, 25),
    locked=120,
    lock_keys=6,
    idem_keys=40,
    pg_outage=(10, 14),
    drain=100,
    drain_cap=100,
)
LONG = Sizes(
    fault_phase=600,
    delays=10_000,
    far_delays=200,
    countdown=(6, 90),
    locked=1_000,
    lock_keys=20,
    idem_keys=300,
    pg_outage=(10, 30),
    drain=120,
    drain_cap=1200,
    stacked_calls=300,
)
SIZES = LONG if SOAK else SHORT

STACKED_ENTRY = "stacked-every-2s"
SCHEDULE: dict[str, dict[str, Any]] = {
    "every-1s": {"every": 1},
    "every-2s": {"every": 2},
    "every-3s": {"every": 3},
    "cron-utc": {"cron": {"minute": "*"}},
    "cron-berlin": {"cron": {"minute": "*", "tz": "Europe/Berlin"}},
    # Stacked gates: the entry's run lease (buffer_all) around a rate limit on its task.
    STACKED_ENTRY: {"every": 2, "task": "faults.entry_over_rate", "overlap": "buffer_all", "overlap_ttl": LOCK_TTL},
}


# --- the cluster -------------------------------------------------------------------------


@dataclass
class Cluster:
    processes: ProcessManager
    env: dict[str, str]
    #: the pid in the beat lease's holder info (None: nobody holds it, or it cannot be read now)
    leader_pid: Callable[[], int | None]
    roles: dict[str, CeleryProcess] = field(default_factory=dict)
    killed: list[CeleryProcess] = field(default_factory=list)
    #: processes that exited by themselves at startup because the coordination database was
    #: unreachable (documented: beat fails loudly at startup), started again as a supervisor would
    exited_at_startup: list[CeleryProcess] = field(default_factory=list)
    restarts: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, role: str) -> CeleryProcess:
        n = self.restarts[role]
        self.restarts[role] += 1
        name = f"{role}.{n}"
        env = dict(self.env)
        if role in ("beat0", "w0"):
            env["SAFE_TIME_LOCAL_CLOCK_SKEW"] = str(SKEW)
        if role == "sweeper":
            env["SAFE_TIME_LOCAL_CLOCK_SKEW"] = str(-SKEW)
        if role.startswith("beat"):
            proc = self.processes.beat(FAULTS_APP, name=name, env=env)
        elif role == "sweeper":
            proc = self.processes.worker(FAULTS_APP, "-Q", "sweep", name=name, env=env, concurrency=1)
        else:
            queues = "celery,sweep" if role == "w0" else "celery"
            proc = self.processes.worker(FAULTS_APP, "-Q", queues, name=name, env=env, concurrency=2)
        self.roles[role] = proc
        return proc

    def restart_beats(self, schedule: dict[str, dict[str, Any]]) -> None:
        """Stop every beat (warm shutdown), then start each again with ``schedule``: a deploy that
        changes the schedule."""
        with self.lock:
            self.env["SAFE_TIME_TEST_BEAT_SCHEDULE"] = json.dumps(schedule)
            beats = sorted(role for role in self.roles if role.startswith("beat"))
            for role in beats:
                self.roles[role].terminate(timeout=60)
            for role in beats:
                self.start(role)

    def kill(self, role: str) -> None:
        with self.lock:
            proc = self.roles[role]
            proc.send(signal.SIGCONT)
            proc.kill()
            self.killed.append(proc)

    def revive_exited_at_startup(self, log: FaultLog) -> None:
        """Start again (as systemd's ``Restart=on-failure`` would) a process that exited at startup
        saying its store was unreachable; any other exit stays a crash the test reports."""
        with self.lock:
            for role, proc in list(self.roles.items()):
                if proc.alive() or proc in self.killed or not STARTUP_UNREACHABLE.search(proc.log()):
                    continue
                log.note(
                    f"supervisor-restart {role} ({proc.name} exited at startup: coordination unreachable)", fault=False
                )
                self.exited_at_startup.append(proc)
                self.start(role)

    def started_or_exited(self) -> bool:
        """Every role's process has finished starting (a worker is ready, a beat is running its
        loop) or has exited (which the run reports)."""
        with self.lock:
            procs = list(self.roles.items())
        return all(
            not proc.alive()
            or re.search(r"beat: Starting\.\.\." if role.startswith("beat") else r"ready\.", proc.log())
            for role, proc in procs
        )

    def leader_role(self) -> str | None:
        pid = self.leader_pid()
        for role, proc in self.roles.items():
            if role.startswith("beat") and proc.alive() and proc.pid == pid:
                return role
        return None


#: What a beat says when it exits at startup because its lease store (the coordination database, or
#: Redis while a fault restarts it) does not answer.
STARTUP_UNREACHABLE = re.compile(r"beat: (PostgreSQL|Redis) .* is unreachable at startup")


# --- load -----------------------------------------------------------------------------------


@dataclass
class Load:
    """What the test process sent; filled by the producer threads."""

    stored: dict[str, float] = field(default_factory=dict)  # task id -> countdown
    cancelled: set[str] = field(default_factory=set)
    cancel_refused: set[str] = field(default_factory=set)
    store_errors: int = 0
    locked_sent: int = 0
    idem_sent: int = 0
    #: task id -> (stacked task kind, call number)
    stacked_sent: dict[str, tuple[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _retry_store(call: Callable[[], Any], load: Load, stop: threading.Event) -> Any:
    while True:
        try:
            return call()
        except StoreError as exc:
            if "already stored" in str(exc):
                return "already"  # the first try committed but its answer was cut off
            load.store_errors += 1
            if stop.is_set() and load.store_errors > 10_000:
                raise
            time.sleep(0.25)


def produce_delays(app: Celery, rng: random.Random, load: Load, window: float, stop: threading.Event) -> None:
    task = app.tasks["faults.delay"]
    total = SIZES.delays + SIZES.far_delays
    plan = sorted(rng.uniform(0, window) for _ in range(total))
    far = set(rng.sample(range(total), SIZES.far_delays))
    start = time.monotonic()
    cancels: list[tuple[float, str]] = []
    try:
        for i, at in enumerate(plan):
            while time.monotonic() - start < at and not stop.is_set():
                time.sleep(0.01)
            countdown = 86400.0 if i in far else rng.uniform(*SIZES.countdown)
            task_id = f"delay-{i:05d}"

            def send(task_id: str = task_id, countdown: float = countdown, i: int = i) -> Any:
                return task.apply_async((f"d{i}",), countdown=countdown, task_id=task_id)

            _retry_store(send, load, stop)
            load.stored[task_id] = countdown
            if rng.random() < 0.05:
                cancels.append((time.monotonic() + rng.uniform(0.5, 3), task_id))
            due = [c for c in cancels if c[0] <= time.monotonic()]
            for c in due:
                cancels.remove(c)
                ok = _retry_store(lambda tid=c[1]: get_store(app).cancel(tid), load, stop)
                (load.cancelled if ok is True else load.cancel_refused).add(c[1])
        for _, task_id in cancels:
            ok = _retry_store(lambda tid=task_id: get_store(app).cancel(tid), load, stop)
            (load.cancelled if ok is True else load.cancel_refused).add(task_id)
    except Exception as exc:  # surfaced by the test
        load.errors.append(f"delay producer: {exc!r}")


def produce_tasks(app: Celery, rng: random.Random, load: Load, window: float, stop: threading.Event) -> None:
    items: list[tuple[float, str, tuple[Any, ...]]] = []
    for n in range(SIZES.locked):
        items.append((rng.uniform(0, window), "faults.locked", (n % SIZES.lock_keys, n, rng.uniform(0.05, 0.3))))
    for key in range(SIZES.idem_keys):
        at = rng.uniform(0, window)
        items.append((at, "faults.idem", (key, 0)))
        items.append((at + rng.uniform(0, 2), "faults.idem", (key, 1)))
    for spec in STACKED_CALLS:
        # bursts of one key, so the rate makes calls wait and the outer gate meets full limits
        for first in range(0, SIZES.stacked_calls, spec.burst):
            at = rng.uniform(0, window)
            for n in range(first, min(first + spec.burst, SIZES.stacked_calls)):
                seconds = rng.uniform(*spec.seconds)
                items.append((at + rng.uniform(0, 0.3), spec.task, ((first // spec.burst) % spec.keys, n, seconds)))
    items.sort(key=lambda item: item[0])
    start = time.monotonic()
    try:
        for at, name, args in items:
            while time.monotonic() - start < at and not stop.is_set():
                time.sleep(0.01)
            # a locked or stacked task's id names it, so the worker logs tell whether any worker received it
            kind = name.split(".")[1]
            task_id = locked_task_id(args[1]) if name == "faults.locked" else None
            if kind in STACKED_KINDS:
                task_id = stacked_task_id(kind, args[1])
            app.send_task(name, args=args, task_id=task_id)
            if name == "faults.locked":
                load.locked_sent += 1
            elif kind in STACKED_KINDS:
                load.stacked_sent[str(task_id)] = (kind, args[1])
            else:
                load.idem_sent += 1
    except Exception as exc:
        load.errors.append(f"task producer: {exc!r}")


def locked_task_id(n: int) -> str:
    return f"faults-locked-{n:05d}"


@dataclass(frozen=True)
class StackedCalls:
    """A task with stacked gates that the producer calls (tests/apps/faults_app.py)."""

    task: str
    keys: int
    burst: int  # calls of one key sent at once
    seconds: tuple[float, float]  # body length


#: The rates and limits of the stacked tasks, by kind: (starts, period in seconds, runs at once).
STACKED_GATES = {
    "lock_over_rate": (2, 2.0, 1),
    "slots_over_rate": (3, 2.0, 2),
    "entry_over_rate": (1, 1.5, 1),
}
STACKED_CALLS = [
    StackedCalls("faults.lock_over_rate", keys=3, burst=3, seconds=(0.05, 0.2)),
    StackedCalls("faults.slots_over_rate", keys=2, burst=4, seconds=(0.3, 1.0)),
]
STACKED_KINDS = {spec.task.split(".")[1] for spec in STACKED_CALLS}


def stacked_task_id(kind: str, n: int) -> str:
    return f"faults-{kind}-{n:05d}"


def lost_in_redis_fetch(
    missing: set[int], held: set[str], worker_logs: str, kills: list[float], now: float, broker: str
) -> set[int]:
    """The locked tasks (of ``missing``) that kombu's Redis transport lost with a killed worker: no
    worker ever logged receiving one, the broker no longer holds it (``held``: :func:`broker_held`),
    and a worker was killed -9 more than a visibility timeout ago (a message it had fetched and
    recorded as unacked is restored by then). Its BRPOP takes the
    message off the queue before the unacked record is written, one round trip later: a kill -9 in
    between loses the message (RabbitMQ keeps it until the ack, so nothing is admitted there).
    Plain Celery on the Redis broker has the same window; stored delays do not (the delivery grace
    publishes them again)."""
    lost = never_received({locked_task_id(n) for n in missing}, held, worker_logs, kills, now, broker)
    return {n for n in missing if locked_task_id(n) in lost}


#: A worker's line saying it received a task, or re-queued it (``retry``): its time, id, and which.
LOGGED_TASK = re.compile(r"^\[(?P<at>[\d-]+ [\d:,]+): [^]]*\] Task [\w.]+\[(?P<id>[^]]+)\] (?P<what>received|retry:)")


def never_received(
    task_ids: set[str], held: set[str], worker_logs: str, kills: list[float], now: float, broker: str
) -> set[str]:
    """:func:`lost_in_redis_fetch` by task id: the last copy of each call that a worker sent to the
    broker was never received (its first message, or the copy a gate re-queued with ``retry``: Redis
    pops a message for a ``BRPOP`` already sent, and a consumer killed before it reads the reply loses
    whichever copy that was)."""
    if broker != "redis" or not any(t < now - VISIBILITY - 5 for t in kills):
        return set()
    received: dict[str, str] = {}
    requeued: dict[str, str] = {}
    for line in worker_logs.splitlines():
        found = LOGGED_TASK.match(line)
        if found is None or found["id"] not in task_ids:
            continue
        seen = received if found["what"] == "received" else requeued
        seen[found["id"]] = max(seen.get(found["id"], ""), found["at"])
    return {
        tid for tid in task_ids if tid not in held and (tid not in received or requeued.get(tid, "") > received[tid])
    }


def broker_held(broker_url: str) -> set[str]:
    """The task ids whose messages kombu's Redis transport still holds: in a queue's list (its
    priority lists too), or fetched by a worker and recorded as unacked (restored to the queue after
    the visibility timeout if the worker dies)."""
    with redis.Redis.from_url(broker_url) as broker:
        raws = [raw for key in broker.scan_iter(_type="list") for raw in broker.lrange(key, 0, -1)]
        raws += [json.loads(raw)[0] for raw in broker.hvals("unacked")]
    held = set()
    for raw in raws:
        try:
            message = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        except ValueError:  # a list of something else in the broker's database
            continue
        task_id = message.get("headers", {}).get("id") if isinstance(message, dict) else None
        if task_id:
            held.add(task_id)
    return held


def worker_logs(processes: ProcessManager) -> str:
    return "\n".join(proc.log() for proc in processes.procs if proc.name.startswith("w"))


# --- faults ---------------------------------------------------------------------------------


@dataclass
class FaultLog:
    events: list[tuple[float, str]] = field(default_factory=list)  # (time.time(), what)
    #: (from, to): the lease/lock Redis lost its data at some instant in between
    resets: list[tuple[float, float]] = field(default_factory=list)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)

    def note(self, what: str, *, fault: bool = True) -> None:
        self.events.append((time.time(), what))
        if fault:
            self.counts[what.split(" ")[0]] += 1
        print(f"[fault {time.strftime('%H:%M:%S')}] {what}", flush=True)


#: How the fault log says the store went away, and came back.
STORE_DOWN = ("pg-unreachable", "pg-restart", "pg-stalled")
STORE_BACK = "pg-back"


#: s: how long after a write a worker may still hold it unrecorded: the end of a run is recorded at
#: once, or retried in the background every 2 s (delays/delivery.py's _FINISH_RETRY_DELAYS) while the
#: store is unreachable, so a store back for less than this between two outages may never see it.
RECORD_SLACK = 3.0


def store_outages(events: list[tuple[float, str]], *, bridge: float = 0.0) -> list[tuple[float, float]]:
    """(down, back) of every time the store was unreachable (a cut or a restart), from the fault log;
    one still open at the end lasts forever. Outages less than ``bridge`` seconds apart count as one."""
    outages: list[tuple[float, float]] = []
    down: float | None = None
    for at, what in sorted(events):
        if what.startswith(STORE_DOWN) and down is None:
            down = outages.pop()[0] if outages and at - outages[-1][1] < bridge else at
        elif what.startswith(STORE_BACK) and down is not None:
            outages.append((down, at))
            down = None
    if down is not None:
        outages.append((down, float("inf")))
    return outages


def unrecorded_at(t: float, ended: float, outages: list[tuple[float, float]]) -> bool:
    """Could a run that ended at ``ended`` still have its end unrecorded at ``t``: within
    ``RECORD_SLACK`` of its end, or of the end of an outage (bridged) that began by then."""
    return ended <= t and (
        t <= ended + RECORD_SLACK
        or any(down <= ended + RECORD_SLACK and t <= back + RECORD_SLACK for down, back in outages if back >= ended)
    )


def inject_faults(
    cluster: Cluster,
    server: RedisServer | None,
    proxy: TcpProxy,
    rng: random.Random,
    log: FaultLog,
    until: float,
    stop: threading.Event,
    pg_server: PostgresServer,
) -> None:
    """``server``: the lease/lock Redis (restarted and flushed), None when the run has no Redis;
    ``pg_server``: the run's own PostgreSQL, stopped (``fast``: orderly; ``immediate``: a crash) and
    started again."""

    def sleep(seconds: float) -> None:
        stop.wait(seconds)

    def kill_restart(role: str) -> None:
        log.note(f"kill-9 {role} ({cluster.roles[role].name})")
        cluster.kill(role)
        sleep(rng.uniform(1, 3))
        cluster.start(role)

    def pause(role: str, seconds: float) -> None:
        proc = cluster.roles[role]
        log.note(f"SIGSTOP {role} ({proc.name}) for {seconds:.1f}s")
        proc.pause()
        sleep(seconds)
        proc.resume()

    def leader() -> str:
        role = wait_for(cluster.leader_role, 60, interval=0.2, message="a beat leader")
        return str(role)

    def redis_restart() -> None:
        assert server is not None
        log.note("redis-restart (lease/lock Redis, no persistence)")
        before = time.time()
        server.restart()
        log.resets.append((before, time.time()))

    def redis_flush() -> None:
        assert server is not None
        log.note("redis-flushall (lease/lock Redis)")
        before = time.time()
        redis.Redis.from_url(server.url).flushall()
        log.resets.append((before, time.time()))

    def redis_script_flush() -> None:
        assert server is not None
        # What a restart or failover does to the script cache, without losing a key: every lock's
        # release or commit written without waiting meets NOSCRIPT until it is loaded again.
        log.note("redis-script-flush (lease/lock Redis: an empty script cache, data kept)")
        redis.Redis.from_url(server.url).script_flush()

    def pg_stall() -> None:
        seconds = rng.uniform(*SIZES.pg_stall)
        log.note(f"pg-stalled for {seconds:.1f}s (the proxy stops forwarding on every open connection)")
        proxy.stall()
        sleep(seconds)
        proxy.resume()
        log.note("pg-back after the stall", fault=False)

    def pg_outage() -> None:
        seconds = rng.uniform(*SIZES.pg_outage)
        log.note(f"pg-unreachable for {seconds:.1f}s")
        proxy.cut()
        sleep(seconds)
        proxy.restore()
        log.note("pg-back")

    def own_pg_restart(mode: str) -> None:
        down = rng.uniform(1, 4)
        log.note(f"pg-restart-{mode} (pg_ctl stop -m {mode}, {down:.1f}s down, start: every connection dropped)")
        out = pg_server.restart(mode, down=down)
        if out.returncode != 0:
            log.errors.append(f"pg-restart -m {mode} failed ({out.returncode}): {out.stderr.strip()}")
        log.note(f"pg-back after -m {mode}")

    faults: list[tuple[str, Callable[[], None]]] = [
        ("kill-leader", lambda: kill_restart(leader())),
        ("pause-leader", lambda: pause(leader(), rng.uniform(LEASE + 2, LEASE + 6))),
        ("kill-worker", lambda: kill_restart(rng.choice(["w0", "w1"]))),
        ("pause-worker", lambda: pause(rng.choice(["w0", "w1"]), rng.uniform(2, 5))),
        ("kill-sweeper", lambda: kill_restart("sweeper")),
        ("pause-sweeper", lambda: pause("sweeper", rng.uniform(2, 5))),
    ]
    if server is not None:
        faults += [
            ("redis-restart", redis_restart),
            ("redis-flush", redis_flush),
            ("redis-script-flush", redis_script_flush),
        ]
    faults += [
        ("pg-outage", pg_outage),
        ("pg-stall", pg_stall),
        ("pg-restart-fast", lambda: own_pg_restart("fast")),
        ("pg-crash", lambda: own_pg_restart("immediate")),
    ]
    try:
        first = True  # the first cycle always completes: every fault happens at least once
        while not stop.is_set() and (first or time.monotonic() < until):
            cycle = faults[:]
            rng.shuffle(cycle)
            for _name, fault in cycle:
                if stop.is_set() or (not first and time.monotonic() >= until):
                    break
                sleep(rng.uniform(0.5, 2) if first else rng.uniform(1, 4))
                fault()
            first = False
    except Exception as exc:
        log.errors.append(f"fault injector: {exc!r}")


# --- checks -----------------------------------------------------------------------------------


def _close_django_connections() -> None:
    try:
        from django.db import connections
    except ImportError:
        return
    connections.close_all()


def reset_between(resets: list[tuple[float, float]], a: float, b: float) -> bool:
    """Did the lease/lock Redis lose its data between the instants ``a`` and ``b``?"""
    lo, hi = min(a, b), max(a, b)
    return any(start <= hi and end >= lo for start, end in resets)


def stacked_expected(scenario: Setup, load: Load, published_before: float) -> set[str]:
    """The task ids that must run: every stacked call, and every slot of the stacked entry that beat
    handed to the broker before ``published_before`` (when the beats dropped the entry, after the
    faults)."""
    slots = {
        str(r["task_id"])
        for r in scenario.records("stacked_published")
        if r["entry"] == STACKED_ENTRY and r["at"] < published_before
    }
    return set(load.stacked_sent) | slots


@dataclass
class StackedCheck:
    """The stacked gates' ledger checked against what their gates promise (docs/locks.md, "Stacking
    gates"): each call (or published slot) runs once, a second run only after its first was cut
    short by a kill -9 (acks_late) or across a lease/lock Redis reset; never more runs of a key at
    once than its limit; never more starts in a period than its rate; no lock held past its ttl."""

    rows: list[tuple[str, Any, str]] = field(default_factory=list)
    failures: dict[str, Any] = field(default_factory=dict)


STACKED_RATE_TOLERANCE = 0.5  # s: a start is recorded a little after its admission (a loaded machine)
DISTURBED_BEFORE = LOCK_TTL  # s: how long before a start a pause or stall can hold up its record


def stacked_locks_held(app: Celery, runs: list[dict[str, Any]]) -> list[str]:
    """The locks of the stacked calls (overlap lock, concurrency slots) still held a ttl after the
    last run ended: every call has run by now, so a holder left is stuck (the entry's run lease, a
    gate of its own, is not looked at)."""
    keys = {str(r["lock"]) for r in runs if r["task"] in STACKED_KINDS and r["lock"]}
    if not keys:
        return []
    last_end = max(r["ended"] for r in runs if r["task"] in STACKED_KINDS)
    time.sleep(max(0.0, last_end + LOCK_TTL + 1 - time.time()))
    store = get_lock_backend(app)
    return sorted(key for key in keys if store.holder_record(key) is not None)


def check_stacked(
    runs: list[dict[str, Any]],
    published: list[dict[str, Any]],
    load: Load,
    faults: FaultLog,
    no_redis: bool,
    fetch_lost: set[str],
    held_past_ttl: list[str],
    published_before: float,
) -> StackedCheck:
    out = StackedCheck()
    resets = faults.resets
    kills = [(t, what.split("(")[-1].rstrip(")")) for t, what in faults.events if what.startswith("kill-9 w")]
    pauses: list[tuple[str, float, float]] = []
    for t, what in faults.events:
        m = re.match(r"SIGSTOP w\d \((\S+)\) for ([\d.]+)s", what)
        if m:
            pauses.append((m.group(1), t, t + float(m.group(2))))
    outages = store_outages(faults.events, bridge=RECORD_SLACK) if no_redis else []

    def proc_name(run: dict[str, Any]) -> str:
        return str(run.get("worker") or "").split("@")[0]

    def disturbed(run: dict[str, Any]) -> bool:
        """A pause of its worker, a stall or cut of the coordination database, or a Redis reset just
        before its start: its start may be recorded later than its admission."""
        lo, hi = run["started"] - DISTURBED_BEFORE, run["started"]
        return (
            any(name == proc_name(run) and a <= hi and b >= lo for name, a, b in pauses)
            or any(a <= hi and b >= lo for a, b in outages)
            or reset_between(resets, lo, hi)
        )

    def killed_before_recorded(run: dict[str, Any]) -> bool:
        """Its worker was killed -9 after the body ended and before the lock's finished record or the
        ack (acks_late's at-least-once window); with no Redis, also while the database was cut."""
        ended = run["ended"]
        return any(name == proc_name(run) and unrecorded_at(t, ended, outages) for t, name in kills)

    by_call: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in runs:
        by_call[(r["task"], r["task_id"])].append(r)
    slot_of = {str(p["task_id"]): p["slot"] for p in published}
    for kind in STACKED_GATES:
        starts, period, at_once = STACKED_GATES[kind]
        mine = [r for r in runs if r["task"] == kind]
        calls = {tid for k, tid in by_call if k == kind}
        if kind == "entry_over_rate":
            # every slot published until the beats dropped the entry must run
            expected = {str(p["task_id"]) for p in published if p["at"] < published_before}
        else:
            expected = {tid for tid, (k, _n) in load.stacked_sent.items() if k == kind}
        unknown = sorted(calls - set(load.stacked_sent) - set(slot_of))
        # a call run twice: admitted when the first run was cut short before its record, or across a reset
        twice: list[str] = []
        admitted_twice: list[str] = []
        for (k, tid), rs in by_call.items():
            if k != kind or len(rs) < 2:
                continue
            rs.sort(key=lambda r: r["started"])
            ok = all(
                killed_before_recorded(a) or reset_between(resets, a["started"], b["ended"])
                for a, b in itertools.pairwise(rs)
            )
            (admitted_twice if ok else twice).append(tid)
        # one slot published twice (two task ids) is the fired marker lost with a reset
        twice_slots = []
        if kind == "entry_over_rate":
            slot_runs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            for r in mine:
                slot_runs[str(r["call"])].append(r)
            for slot, rs in slot_runs.items():
                ids = sorted({r["task_id"] for r in rs})
                if len(ids) > 1 and not reset_between(
                    resets, min(r["started"] for r in rs), max(r["ended"] for r in rs)
                ):
                    twice_slots.append(slot)
        # never more than the limit at once, among runs that ended holding their lock
        over_limit: list[Any] = []
        admitted_over: list[Any] = []
        held = [r for r in mine if r["outcome"] == "finished"]
        for key in {r["key"] for r in held}:
            rs = sorted((r for r in held if r["key"] == key), key=lambda r: r["started"])
            for i, r in enumerate(rs):
                beside = [o for o in rs[:i] if o["ended"] > r["started"]]
                if len(beside) + 1 > at_once:
                    span = (min(o["started"] for o in beside), r["ended"])
                    (admitted_over if reset_between(resets, *span) else over_limit).append((r, beside))
        # never more starts in a period than the rate (every run that started, told or not)
        too_fast: list[Any] = []
        admitted_fast: list[Any] = []
        for key in {r["key"] for r in mine}:
            rs = sorted((r for r in mine if r["key"] == key), key=lambda r: r["started"])
            for window in (rs[i : i + starts + 1] for i in range(len(rs) - starts)):
                if window[-1]["started"] - window[0]["started"] >= period - STACKED_RATE_TOLERANCE:
                    continue
                (admitted_fast if any(disturbed(r) for r in window) else too_fast).append(window)
        never = sorted(expected - calls - fetch_lost)
        told = sum(1 for r in mine if r["outcome"] == "lost")
        lost_fetch = len((expected - calls) & fetch_lost)
        out.rows += [
            (
                f"stacked {kind}: calls run",
                len(calls & expected),
                f"of {len(expected)}"
                + (" published" if kind == "entry_over_rate" else "")
                + f", {len(mine)} runs, {told} told LockLost, {lost_fetch} lost in the Redis broker's fetch window",
            ),
            (
                f"stacked {kind}: calls run twice",
                len(twice) + len(twice_slots),
                "ok" if not (twice or twice_slots) else "FAIL",
            ),
            (
                f"stacked {kind}: second runs admitted",
                len(admitted_twice),
                "killed -9 before the run was recorded, or a Redis reset",
            ),
            (
                f"stacked {kind}: more than {at_once} at once",
                len(over_limit),
                ("ok" if not over_limit else "FAIL") + f" ({len(admitted_over)} across a Redis reset)",
            ),
            (
                f"stacked {kind}: over {starts}/{period:g}s",
                len(too_fast),
                ("ok" if not too_fast else "FAIL") + f" ({len(admitted_fast)} beside a pause, stall or reset)",
            ),
        ]
        out.failures.update(
            {
                f"stacked {kind} never ran": never[:10],
                f"stacked {kind} unknown runs": unknown[:10],
                f"stacked {kind} twice": {tid: by_call[(kind, tid)] for tid in twice[:5]},
                f"stacked {kind} slots twice": twice_slots[:5],
                f"stacked {kind} over the limit": over_limit[:3],
                f"stacked {kind} over the rate": too_fast[:3],
            }
        )
    out.rows.append(("stacked locks held past their ttl", len(held_past_ttl), "ok" if not held_past_ttl else "FAIL"))
    out.failures["stacked locks held past their ttl"] = held_past_ttl
    out.failures = {k: v for k, v in out.failures.items() if v}
    return out


#: ERROR/CRITICAL log lines the injected faults explain, by cause. Anything else fails the test.
EXPECTED_ERRORS = [
    ("sweep: store unreachable", r"celery_safe_time\.sweep\[.*\] raised unexpected: StoreError\("),
    ("sweep: published, not marked sent", r"sweep: published \d+ stored delays but could not mark them sent"),
    ("beat: lease Redis unreachable", r"beat: Redis unreachable, nothing fires until it is back"),
    ("beat: Redis error in tick", r"beat: Redis error during tick, standing by"),
    ("beat: coordination PostgreSQL unreachable", r"beat: PostgreSQL unreachable, nothing fires until it is back"),
    ("beat: PostgreSQL error in tick", r"beat: PostgreSQL error during tick, standing by"),
    ("beat: exited at startup, coordination unreachable", r"beat raised exception .*is unreachable at startup"),
    ("lock: lost (Redis reset)", r"overlap lock .* lost"),
    (
        "lock: task ended with LockLost",
        r"faults\.(locked|lock_over_rate|slots_over_rate|entry_over_rate)\[.*\] raised unexpected: LockLost\(",
    ),
    ("idem: marker not written", r"idempotency key .* (could not|cannot) be recorded"),
    ("worker: lost connection", r"consumer: (Cannot connect|Connection to broker lost)"),
    ("beat: publish failed", r"beat: entry .* not published: "),
    ("pool: child killed", r"Process '.*' pid:\d+ exited with 'signal 9 \(SIGKILL\)'"),
    ("worker lost (killed pool)", r"WorkerLostError"),
    ("delay: end not recorded (store unreachable)", r"ended \(\w+\) but the store did not record it"),
    # An acks_late stored run whose heartbeat cannot be written for its lock ttl (the store cut, stalled
    # or restarting for longer) is interrupted and left to the sweep, which runs it again.
    ("delay: delivery record lost (store unreachable)", r"stored task .* lost its delivery record: no heartbeat"),
]
#: Exceptions a traceback in a log may end with (all caused by the injected faults).
EXPECTED_EXCEPTIONS = re.compile(
    r"^(celery_safe_time\.exceptions\.(StoreError|RedisUnavailable|CoordinationUnavailable|LockLost)|redis\.exceptions\.\w+|"
    r"ConnectionRefusedError|ConnectionResetError|BrokenPipeError|TimeoutError|OSError|"
    r"sqlalchemy\.exc\.OperationalError|psycopg\.OperationalError|kombu\.exceptions\.OperationalError|"
    r"billiard\.exceptions\.WorkerLostError|celery_safe_time\.exceptions\.LeaseLost|"
    # the delays whose first run gives its message back (faults_app.BODY_FAULTS); billiard's wrapper
    # quotes the exception from the pool child, whose own traceback block is checked on its own
    r"celery\.exceptions\.Reject: \('given back by the fault scenario', True\)|"
    r"billiard\.einfo\.ExceptionWithTraceback: $|"
    r"celery_safe_time\.exceptions\.ImproperlyConfigured: \w+: beat: (PostgreSQL|Redis) .* "
    r"is unreachable at startup)"
)


def scan_log(text: str) -> tuple[collections.Counter[str], list[str], list[str]]:
    """(expected ERROR lines by cause, unexpected ERROR lines, unexpected traceback endings)."""
    known: collections.Counter[str] = collections.Counter()
    unknown: list[str] = []
    for line in text.splitlines():
        if not re.search(r": (ERROR|CRITICAL)/", line):
            continue
        for cause, pattern in EXPECTED_ERRORS:
            if re.search(pattern, line):
                known[cause] += 1
                break
        else:
            unknown.append(line)
    bad_tracebacks: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            tail = [ln for ln in lines[i + 1 :] if ln.strip() and not ln.startswith((" ", "\t", "Traceback"))]
            end = tail[0] if tail else ""
            if len(tail) > 1 and tail[1].startswith(("The above exception", "During handling")):
                continue  # chained: the final block is checked on its own
            if not EXPECTED_EXCEPTIONS.search(end):
                bad_tracebacks.append(end)
    return known, unknown, bad_tracebacks


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def table(rows: list[tuple[str, Any, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    out = [f"| {'check'.ljust(width)} | count | result |", f"|{'-' * (width + 2)}|------:|--------|"]
    out += [f"| {name.ljust(width)} | {value!s:>5} | {verdict} |" for name, value, verdict in rows]
    return "\n".join(out)


# --- the scenario -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What one run of the scenario is made of (the rest of it is the same for all three)."""

    broker: str  # "redis" or "amqp"
    coordination: str  # "redis" (a lease/lock Redis) or "postgres" (the store's database, no Redis)

    @property
    def no_redis(self) -> bool:
        return self.coordination == "postgres"


RUNS = {
    "redis": Run("redis", "redis"),
    "amqp": Run("amqp", "redis"),
    "postgres-amqp": Run("amqp", "postgres"),
}


@dataclass
class Setup:
    run: Run
    processes: ProcessManager
    broker_url: str
    #: the scenario's own database (SQLAlchemy URL): the store, and on PostgreSQL the coordination too
    postgres_url: str
    #: where the processes record their runs: a Redis URL or ``file:///dir``
    record_url: str
    make_app: Callable[..., Celery]
    #: the run's own PostgreSQL server, which the faults stop and start
    pg_server: PostgresServer
    #: the lease/lock Redis the faults restart and flush (None: no Redis in the run)
    lease_server: RedisServer | None = None

    def records(self, kind: str) -> list[dict[str, Any]]:
        parts = urlsplit(self.record_url)
        if parts.scheme != "file":
            client = redis.Redis.from_url(self.record_url)
            try:
                return [json.loads(raw) for raw in client.lrange(f"faults:{kind}", 0, -1)]
            finally:
                client.close()
        # One file per kind and process (tests/apps/faults_app.py): merged in time order.
        found = [
            json.loads(line)
            for path in Path(parts.path).glob(f"{kind}.*.jsonl")
            for line in path.read_text().splitlines()
            if line.strip()
        ]
        return sorted(found, key=lambda r: r.get("started") or r.get("ended") or r.get("at") or 0)


def _sqlalchemy_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture(params=list(RUNS))
def scenario(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    """Every run gets a PostgreSQL server of its own (the faults stop and start it, which would cut
    every other test's connections on the machine's server) and, on Redis coordination, a
    redis-server of its own for the leases and locks: the three runs can go beside other tests."""
    run = RUNS[request.param]
    server = PostgresServer().start()
    postgres_url = _sqlalchemy_url(services.PostgresDatabase(server.admin_url).url)
    try:
        if not run.no_redis:
            redis_url: str = request.getfixturevalue("redis_url")
            yield Setup(
                run=run,
                processes=request.getfixturevalue("processes"),
                broker_url=redis_url if run.broker == "redis" else request.getfixturevalue("amqp_url"),
                postgres_url=postgres_url,
                record_url=redis_url,
                make_app=request.getfixturevalue("make_app"),
                lease_server=request.getfixturevalue("redis_server"),
                pg_server=server,
            )
            return
        yield from _no_redis_setup(request, tmp_path, run, server, postgres_url)
    finally:
        server.stop()


def _no_redis_setup(
    request: pytest.FixtureRequest, tmp_path: Path, run: Run, server: PostgresServer, postgres_url: str
) -> Iterator[Setup]:
    # No fixture that touches Redis (redis_url, make_app, processes flush or claim a Redis db).
    amqp_url: str = request.getfixturevalue("amqp_url")
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    apps: list[Celery] = []

    def make_app(main: str, **conf: Any) -> Celery:
        app = Celery(main, set_as_current=False)
        app.conf.update(
            safe_time_store_namespace="tests", broker_connection_retry_on_startup=True, timezone="UTC", **conf
        )
        apps.append(app)
        return app

    try:
        with managed_processes(request, tmp_path, {}) as processes:
            yield Setup(
                run=run,
                processes=processes,
                broker_url=amqp_url,
                postgres_url=postgres_url,
                record_url=record_dir.as_uri(),
                make_app=make_app,
                pg_server=server,
            )
    finally:
        from celery_safe_time.coordination import dispose_engines
        from celery_safe_time.delays.backends import reset_store

        for app in apps:
            reset_store(app)
            app.close()
        dispose_engines()


def _redis_leader_pid(url: str) -> Callable[[], int | None]:
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def pid() -> int | None:
        try:
            raw = client.get("safe_time:beat:leader")
            return int(json.loads(raw)["pid"]) if raw else None
        except (redis.RedisError, ValueError, KeyError):
            return None

    return pid


def _postgres_leader_pid(store: SQLAlchemyStore) -> Callable[[], int | None]:
    def pid() -> int | None:
        try:
            with store.engine.connect() as conn:
                info = conn.exec_driver_sql(
                    "SELECT info FROM safe_time_beat_lease WHERE token IS NOT NULL AND expires_at > clock_timestamp()"
                ).scalar()
            return int(json.loads(info)["pid"]) if info else None
        except Exception:  # no table yet, the server restarting: nobody known to hold it now
            return None

    return pid


def assert_no_redis(conf: dict[str, Any], env: dict[str, str]) -> None:
    """The run on PostgreSQL coordination is given nothing that names a Redis."""
    given = json.dumps(conf) + json.dumps(env)
    assert "redis" not in given.lower(), f"a Redis in the settings of a run that must have none: {given}"


@pytest.mark.timeout(2100 if SOAK else 290)
def test_combined_faults_nothing_lost_nothing_twice(
    scenario: Setup,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("SAFE_TIME_SOAK_SEED") or random.SystemRandom().randrange(1_000_000))
    rng = random.Random(seed)
    run = scenario.run
    broker_url = scenario.broker_url
    processes = scenario.processes
    with capsys.disabled():
        print(
            f"\n[faults] seed={seed} mode={'soak' if SOAK else 'short'} broker={run.broker} "
            f"coordination={run.coordination} (replay: SAFE_TIME_SOAK_SEED={seed})"
        )
    started_at = time.monotonic()

    postgres_url = scenario.postgres_url
    proxy, proxied = proxy_for(postgres_url)
    conf: dict[str, Any] = {
        "safe_time_beat_lease": LEASE,
        "safe_time_sweep_interval": 1,
        "safe_time_sweep_queue": "sweep",
        "safe_time_claim_timeout": 15,
        "safe_time_delay_threshold": 5,
        "safe_time_lock_ttl": LOCK_TTL,
        # A published delay no worker started (a message lost with a killed worker) goes out again.
        "safe_time_delivery_grace": DELIVERY_GRACE,
        "broker_transport_options": {
            "visibility_timeout": VISIBILITY,
            # seed 699458: a worker killed -9 in kombu's restore scan held its mutex (300 s by
            # default), so no worker gave back its unacked messages within the drain
            **services.REDIS_FAST_RESTORE,
        },
    }
    if scenario.lease_server is not None:
        conf.update(safe_time_redis_url=scenario.lease_server.url, result_backend=scenario.record_url)
    else:
        # Coordination in the store's database (through the proxy, so its cuts reach beat and the
        # locks too); no result backend: nothing here reads a result.
        conf.update(safe_time_coordination_url="store", result_backend=None)
    env = {
        "SAFE_TIME_TEST_BROKER_URL": broker_url,
        "SAFE_TIME_TEST_RECORD_URL": scenario.record_url,
        "SAFE_TIME_TEST_STORE_URL": proxied,
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
        "SAFE_TIME_TEST_BEAT_SCHEDULE": json.dumps(SCHEDULE),
        "SAFE_TIME_TEST_LOCK_TTL": str(LOCK_TTL),
        "SAFE_TIME_TEST_BODY_FAULTS": "1" if BODY_FAULTS else "",
    }
    if run.no_redis:
        assert_no_redis(conf, env)
    # The test's own producer app: same broker, same (proxied) store.
    app = scenario.make_app("faults-producer", broker_url=broker_url, safe_time_store_url=proxied, **conf)
    install(app)

    @app.task(base=SafeTask, name="faults.delay", shared=False)
    def delay(label: str) -> None: ...

    direct = SQLAlchemyStore(postgres_url)
    direct.ensure_schema()

    leader_pid = (
        _redis_leader_pid(scenario.lease_server.url)
        if scenario.lease_server is not None
        else _postgres_leader_pid(direct)
    )
    cluster = Cluster(processes, env, leader_pid)
    for role in ("w0", "w1", "sweeper", "beat0", "beat1", "beat2"):
        cluster.start(role)
    for role in ("w0", "w1", "sweeper"):
        cluster.roles[role].wait_for_log(r"ready\.", timeout=120)
    wait_for(cluster.leader_role, 60, message="a beat leader")

    load = Load()
    faults = FaultLog()
    stop = threading.Event()

    def supervise() -> None:
        while not stop.wait(1):
            cluster.revive_exited_at_startup(faults)

    threading.Thread(target=supervise, name="supervisor", daemon=True).start()
    redis_watch = RedisWatch()
    if run.no_redis:

        def watch_for_redis() -> None:
            while not stop.wait(2):
                redis_watch.sample([p.pid for p in processes.procs if p.alive()])

        redis_watch.sample([p.pid for p in processes.procs if p.alive()])
        threading.Thread(target=watch_for_redis, name="redis-watch", daemon=True).start()
    window = SIZES.fault_phase - 15
    threads = [
        threading.Thread(target=produce_delays, args=(app, rng, load, window, stop), daemon=True),
        threading.Thread(target=produce_tasks, args=(app, random.Random(seed + 1), load, window, stop), daemon=True),
        threading.Thread(
            target=inject_faults,
            args=(
                cluster,
                scenario.lease_server,
                proxy,
                random.Random(seed + 2),
                faults,
                time.monotonic() + SIZES.fault_phase,
                stop,
                scenario.pg_server,
            ),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    threads[2].join(SIZES.fault_phase + 120)
    for t in threads[:2]:
        t.join(SIZES.fault_phase + 120)
    # Everything back: nothing paused, the database reachable, every role running.
    proxy.restore()
    for proc in cluster.roles.values():
        proc.resume()
    # A role the faults restarted last may still be starting; the end of the run stops every role,
    # and a SIGTERM that lands before Celery installs its handlers ends the process with -15 and an
    # empty log (seed 670358), which would read as a crash.
    wait_for(cluster.started_or_exited, 120, interval=0.5, message="every role started")
    fault_end = time.monotonic()
    # The stacked entry then leaves the schedule, as a deploy removes an entry: every slot published
    # until the beats stopped must still run once, and no new slot competes with them in the drain
    # (a slot every 2 s against a rate of 1 in 1.5 s catches up a backlog at a fraction of its rate).
    cluster.restart_beats({name: spec for name, spec in SCHEDULE.items() if name != STACKED_ENTRY})
    entry_dropped_at = time.time()  # no beat publishes a slot of the stacked entry from here on
    wait_for(cluster.started_or_exited, 120, interval=0.5, message="every beat started again")
    wait_for(cluster.leader_role, 60, message="a beat leader after the restart")

    # --- drain: every due delay ran, every locked / idempotent / stacked task done ----------
    drain_state: dict[str, Any] = {}
    fetch_lost: set[int] = set()  # locked tasks lost in the Redis transport's fetch window (admitted)
    stacked_fetch_lost: set[str] = set()  # the same for stacked calls and the stacked entry's slots

    def open_work() -> tuple[int, int]:
        """(calls and rows still to end, calls and rows ended so far)."""
        counts = direct.counts()
        now = direct.now()
        expected_stacked = stacked_expected(scenario, load, entry_dropped_at)
        # every row due before the far ones (a day out) ran to its end: none pending, claimed, sent, started
        # (a stacked call's wait past the delay threshold is a stored row too; of the stacked entry, the
        # slots published until the beats dropped it)
        open_rows = [
            r
            for r in direct.list(limit=1_000_000)
            if r.status in (C.STATUS_PENDING, C.STATUS_CLAIMED, C.STATUS_SENT, C.STATUS_STARTED)
            and r.due_at <= now + timedelta(hours=1)
            and (r.task != SCHEDULE[STACKED_ENTRY]["task"] or r.id in expected_stacked)
        ]
        locked_done = {r["n"] for r in scenario.records("lock") if r["outcome"] == "finished"}
        idem_done = {r["key"] for r in scenario.records("idem")}
        stacked_runs = {r["task_id"] for r in scenario.records("stacked")}
        stacked_open = expected_stacked - stacked_runs
        missing = set(range(SIZES.locked)) - locked_done
        fetch_lost.clear()
        stacked_fetch_lost.clear()
        if not open_rows and (missing or stacked_open):
            # Told apart only once the stored backlog is gone (the broker's queues are short by then): a
            # call still queued, or fetched and recorded as unacked, is late, not lost.
            worker_kills = [t for t, what in faults.events if what.startswith("kill-9 w")]
            logs = worker_logs(processes)
            held = broker_held(broker_url) if run.broker == "redis" else set()
            fetch_lost.update(lost_in_redis_fetch(missing, held, logs, worker_kills, time.time(), run.broker))
            stacked_fetch_lost.update(never_received(stacked_open, held, logs, worker_kills, time.time(), run.broker))
        locked_left = missing - fetch_lost
        stacked_left = stacked_open - stacked_fetch_lost
        idem_left = set(range(SIZES.idem_keys)) - idem_done
        drain_state.update(
            stacked_missing=sorted(stacked_left)[:5],
            open_rows=[(r.id, r.status, str(r.due_at)) for r in open_rows[:5]],
            open_row_count=len(open_rows),
            claimed=counts[C.STATUS_CLAIMED],
            started=counts[C.STATUS_STARTED],
            locked_missing=sorted(locked_left)[:5],
            idem_missing=sorted(idem_left)[:5],
        )
        left = len(open_rows) + len(locked_left) + len(idem_left) + len(stacked_left)
        ended = len(scenario.records("delay_end")) + len(locked_done) + len(idem_done) + len(stacked_runs)
        return left, ended

    # The load can outrun the workers (four pool processes, paused, killed and cut from the store
    # for minutes), so the faults may end with a backlog: it must shrink until nothing is left.
    drain_started = time.monotonic()
    backlog, ended_before = open_work()
    last_progress = drain_started
    drain_ok = backlog == 0
    while not drain_ok:
        time.sleep(1.0)
        left, ended = open_work()
        now_m = time.monotonic()
        if ended > ended_before:
            ended_before, last_progress = ended, now_m
        if left == 0:
            drain_ok = True
        elif now_m - last_progress > SIZES.drain or now_m - drain_started > SIZES.drain_cap:
            break
    drain_seconds = time.monotonic() - drain_started
    if not drain_ok and broker_url.startswith("redis"):
        # what kombu's Redis transport still holds back: unacked messages and who may restore them
        with redis.Redis.from_url(broker_url) as broker:
            drain_state.update(
                broker_unacked=broker.hlen("unacked"), broker_restore_mutex_ttl=broker.ttl("unacked_mutex")
            )
    time.sleep(2)
    held_past_ttl = stacked_locks_held(app, scenario.records("stacked"))
    stop.set()

    # --- collect ----------------------------------------------------------------------------
    rows = {r.id: r for r in direct.list(limit=1_000_000)}
    db_now = direct.now()
    delay_runs = collections.defaultdict(list)
    for r in scenario.records("delay"):
        delay_runs[r["task_id"]].append(r)
    periodic = scenario.records("periodic")
    lock_runs = scenario.records("lock")
    idem_runs = scenario.records("idem")
    resets = faults.resets
    stacked = check_stacked(
        scenario.records("stacked"),
        [r for r in scenario.records("stacked_published") if r["entry"] == STACKED_ENTRY],
        load,
        faults,
        run.no_redis,
        stacked_fetch_lost,
        held_past_ttl,
        entry_dropped_at,
    )

    if run.no_redis:
        redis_watch.sample([p.pid for p in processes.procs if p.alive()])  # once more, everything up
    pg_restarts = sum(faults.counts[k] for k in ("pg-restart", "pg-restart-fast", "pg-restart-immediate"))
    alive_at_end = {role: proc.alive() for role, proc in cluster.roles.items()}
    exit_codes = {}
    # Beats first (nothing new is published), then the sweeper, then the workers finish what they hold.
    for role in sorted(cluster.roles, key=lambda r: (not r.startswith("beat"), r != "sweeper", r)):
        proc = cluster.roles[role]
        exit_codes[proc.name] = proc.terminate(timeout=60)
    killed_codes = {p.name: p.proc.returncode if p.proc else None for p in cluster.killed}

    # delays: every due one ran to its end once; a run killed mid-body may have been started again
    delay_ends = collections.defaultdict(list)
    for r in scenario.records("delay_end"):
        delay_ends[r["task_id"]].append(r)
    # A cancel whose reply a store fault lost (it committed; the retry then found nothing pending) is
    # told apart by the row itself: cancelled in the store is cancelled, and must not run.
    for tid in load.cancel_refused & set(rows):
        if rows[tid].status == C.STATUS_CANCELLED:
            load.cancelled.add(tid)
    not_cancelled = [tid for tid in load.stored if tid not in load.cancelled]
    ran_once = [tid for tid in not_cancelled if len(delay_ends[tid]) == 1]
    # a delay whose first run gave its message back (Reject(requeue=True), retry(), SystemExit) must
    # still run to its end exactly once
    given_back_runs = scenario.records("delay_given_back")
    given_back = {r["task_id"]: r["fault"] for r in given_back_runs}
    given_back_lost = sorted(tid for tid in given_back if not delay_ends[tid])
    rerun_after_kill = [tid for tid in ran_once if len(delay_runs[tid]) > 1 and tid not in given_back]
    future = [
        tid
        for tid in not_cancelled
        if not delay_runs[tid] and tid in rows and rows[tid].status == C.STATUS_PENDING and rows[tid].due_at > db_now
    ]
    lost = [tid for tid in not_cancelled if not delay_ends[tid] and tid not in future]
    # A run whose worker was killed after its body ended and before the store recorded the end (a
    # few milliseconds) looks dead: acks_late runs it again. That is acks_late's at-least-once window
    # (plain Celery has it between the body and the ack), counted apart; any other second end fails.
    kills = [(t, what.split("(")[-1].rstrip(")")) for t, what in faults.events if what.startswith("kill-9 w")]

    # The same when the store was unreachable from then on until the kill: the worker keeps trying to
    # record the end in the background while it lives, and a kill before the store is back (or
    # within RECORD_SLACK after; outages closer than that count as one) leaves the run looking dead
    # all the same.
    outages = store_outages(faults.events, bridge=RECORD_SLACK)

    # A body that raises SystemExit ends its pool child as a kill would: an end that child was still
    # recording in the background (the store unreachable) dies with it.
    exits = [(r["started"], r["pid"]) for r in given_back_runs if r["fault"] == "exit"]

    def killed_before_recorded(end: dict[str, Any]) -> bool:
        name = str(end.get("worker") or "").split("@")[0]
        ended = end["ended"]
        return any(proc == name and unrecorded_at(t, ended, outages) for t, proc in kills) or any(
            pid == end.get("pid") and unrecorded_at(t, ended, outages) for t, pid in exits
        )

    repeated_ends = {tid: sorted(ends, key=lambda e: e["ended"]) for tid, ends in delay_ends.items() if len(ends) > 1}
    end_not_recorded = sorted(
        tid for tid, ends in repeated_ends.items() if len(ends) == 2 and killed_before_recorded(ends[0])
    )
    # The same window for a run that called retry(): its retry message is out, and a kill before the
    # store recorded the row's end as retried leaves the row looking dead, so the retry and the
    # sweep's re-run of the row both run to their end (the publish and the record are not one
    # transaction either).
    retried = {r["task_id"]: r for r in given_back_runs if r["fault"] == "retry"}
    retry_not_recorded = sorted(
        tid
        for tid, ends in repeated_ends.items()
        if len(ends) == 2 and tid not in end_not_recorded and tid in retried and killed_before_recorded(retried[tid])
    )
    twice_delay = sorted(set(repeated_ends) - set(end_not_recorded) - set(retry_not_recorded))

    # a re-run never starts beside the run it replaces: that one was killed before the re-run began
    def run_ended_by(run: dict[str, Any]) -> float:
        """When a run's body was over: 0.15 s after its start, or at the kill of its worker before that
        (a plain message, such as a retry's copy, comes back at once when its worker is killed)."""
        name = str(run.get("worker") or "").split("@")[0]
        end = float(run["started"]) + 0.15
        return min((t for t, proc in kills if proc == name and run["started"] <= t < end), default=end)

    beside = [
        tid
        for tid in [*rerun_after_kill, *given_back]
        for a, b in itertools.pairwise(sorted(delay_runs[tid], key=lambda r: r["started"]))
        if b["started"] < run_ended_by(a)
    ]
    cancelled_ran = [tid for tid in load.cancelled if delay_runs[tid]]
    # the clocks: a skewed sweeper or worker (local clock +-300 s) must not make anything early
    lateness = [
        r["started"] - datetime.fromisoformat(r["stored"]).timestamp()
        for runs in delay_runs.values()
        for r in runs
        if r["stored"]
    ]
    early_delays = [x for x in lateness if x < -EARLY_TOLERANCE]
    failed_rows = [r for r in rows.values() if r.status == C.STATUS_FAILED]
    interrupted_rows = [r for r in rows.values() if r.outcome == C.OUTCOME_INTERRUPTED]
    unknown_runs = [tid for tid in delay_runs if tid not in load.stored]

    # periodic slots
    by_slot = collections.defaultdict(list)
    for r in periodic:
        by_slot[(r["entry"], r["slot"])].append(r)
    slot_repeats = {k: v for k, v in by_slot.items() if len(v) > 1}
    admitted_slots = [k for k, v in slot_repeats.items() if reset_between(resets, v[0]["started"], v[-1]["started"])]
    twice_slots = sorted(set(slot_repeats) - set(admitted_slots))
    no_slot_header = [r for r in periodic if not r["slot"]]
    slot_lateness = [r["started"] - datetime.fromisoformat(r["slot"]).timestamp() for r in periodic if r["slot"]]
    early_slots = [x for x in slot_lateness if x < -EARLY_TOLERANCE]
    per_entry = collections.Counter(r["entry"] for r in periodic)

    # lock overlaps (among runs that finished believing they held the lock)
    finished = [r for r in lock_runs if r["outcome"] == "finished"]
    overlaps: list[tuple[dict[str, Any], dict[str, Any]]] = []
    by_key = collections.defaultdict(list)
    for r in finished:
        by_key[r["key"]].append(r)
    for runs in by_key.values():
        runs.sort(key=lambda r: r["started"])
        for a, b in itertools.pairwise(runs):
            if b["started"] < a["ended"]:
                overlaps.append((a, b))
    admitted_overlaps = [o for o in overlaps if reset_between(resets, o[0]["started"], o[1]["ended"])]
    bad_overlaps = [o for o in overlaps if o not in admitted_overlaps]
    lock_lost = [r for r in lock_runs if r["outcome"] == "lost"]

    # idempotency
    idem_by_key = collections.defaultdict(list)
    for r in idem_runs:
        idem_by_key[r["key"]].append(r)
    idem_repeats = {k: v for k, v in idem_by_key.items() if len(v) > 1}
    idem_ok = {r["task_id"] for r in scenario.records("idem_ok")}
    admitted_idem = [k for k, v in idem_repeats.items() if reset_between(resets, v[0]["started"], v[-1]["started"])]
    # the docs' window: the process died between the body and the marker (no success recorded)
    cut_short_idem = [
        k
        for k, v in idem_repeats.items()
        if k not in admitted_idem and any(r["task_id"] not in idem_ok for r in v[:-1])
    ]
    twice_idem = sorted(set(idem_repeats) - set(admitted_idem) - set(cut_short_idem))

    # processes and logs
    crashed = [role for role, alive in alive_at_end.items() if not alive]
    bad_exit = {name: rc for name, rc in exit_codes.items() if rc not in (0, None)}
    bad_kill = {name: rc for name, rc in killed_codes.items() if rc != -9}
    error_causes: collections.Counter[str] = collections.Counter()
    unexpected_errors: list[str] = []
    bad_tracebacks: list[str] = []
    for proc in processes.procs:
        known, unknown, tbs = scan_log(proc.log())
        error_causes.update(known)
        unexpected_errors += [f"{proc.name}: {line}" for line in unknown]
        bad_tracebacks += [f"{proc.name}: {line}" for line in tbs]
    sweep_errors_logged = error_causes["sweep: store unreachable"]

    ok = "ok"
    rows_out: list[tuple[str, Any, str]] = [
        ("seed", seed, f"mode {'soak' if SOAK else 'short'}"),
        (
            "faults injected",
            sum(faults.counts.values()),
            ", ".join(f"{k} {v}" for k, v in sorted(faults.counts.items())),
        ),
        (
            ("Redis resets", len(resets), "none: no Redis in this run")
            if run.no_redis
            else ("lease/lock Redis resets (restart + flush)", len(resets), "data loss the design admits")
        ),
        (
            (
                "Redis processes / connections seen",
                len(redis_watch.redis_processes) + len(redis_watch.redis_connections),
                (ok if redis_watch.clean else "FAIL")
                + f" ({redis_watch.samples} looks at up to {redis_watch.most_processes} processes)",
            )
            if run.no_redis
            else ("Redis processes / connections seen", "-", "not watched: Redis is part of this run")
        ),
        (
            "PostgreSQL restarts",
            pg_restarts,
            (
                f"own server: -m fast {faults.counts['pg-restart-fast']}, "
                f"-m immediate (crash) {faults.counts['pg-restart-immediate']}"
            ),
        ),
        ("delays stored", len(load.stored), f"{load.store_errors} StoreError retries while PG was cut"),
        ("delays cancelled", len(load.cancelled), ok if not cancelled_ran else f"FAIL: {len(cancelled_ran)} ran"),
        ("delays ran exactly once", len(ran_once), ok),
        (
            "delay runs started before due_at",
            len(early_delays),
            (ok if not early_delays else "FAIL")
            + f" (lateness p50 {pct(lateness, 50):.2f}s, max {pct(lateness, 100):.1f}s)",
        ),
        ("delays pending, due in the future", len(future), ok),
        ("delays lost (due, never ran to its end)", len(lost), ok if not lost else "FAIL"),
        (
            "delays re-run after a kill before the run was recorded",
            len(rerun_after_kill) + len(end_not_recorded) + len(retry_not_recorded),
            (ok if not beside else f"FAIL: {len(beside)} beside the killed run") + " (acks_late: at least once)",
        ),
        (
            "  of them: killed (or its pool child exited) before the record",
            len(end_not_recorded),
            "acks_late: the body and the store's record of it are not one transaction",
        ),
        (
            "  of them: a retry() killed before its record, the retry and the re-run both ran",
            len(retry_not_recorded),
            "acks_late: the retry's publish and the store's record of it are not one transaction",
        ),
        (
            "delays whose first run gave its message back",
            len(given_back),
            (ok if not given_back_lost else f"FAIL: {len(given_back_lost)} never ran to its end")
            + " ("
            + ", ".join(f"{kind} {n}" for kind, n in sorted(collections.Counter(given_back.values()).items()))
            + ")",
        ),
        ("delays ran twice (two ends)", len(twice_delay), ok if not twice_delay else "FAIL"),
        ("stored rows failed", len(failed_rows), ok if not failed_rows else "FAIL"),
        (
            "stored rows interrupted (acks_late: must re-run)",
            len(interrupted_rows),
            ok if not interrupted_rows else "FAIL",
        ),
        ("periodic runs", len(periodic), ", ".join(f"{k} {v}" for k, v in sorted(per_entry.items()))),
        ("periodic slots run twice", len(twice_slots), ok if not twice_slots else "FAIL"),
        (
            "periodic runs started before their slot",
            len(early_slots),
            (ok if not early_slots else "FAIL") + f" (lateness p50 {pct(slot_lateness, 50):.2f}s, "
            f"max {pct(slot_lateness, 100):.1f}s)",
        ),
        (
            "periodic slots twice across a Redis reset",
            len(admitted_slots),
            "none: no Redis (any repeat fails)" if run.no_redis else "admitted (fired markers lost)",
        ),
        ("locked tasks finished", len({r["n"] for r in finished}), f"of {SIZES.locked}"),
        (
            "locked tasks lost in the Redis broker's fetch window",
            len(fetch_lost),
            "admitted (a worker killed -9 between kombu's BRPOP and its unacked record)"
            if run.broker == "redis"
            else "none on RabbitMQ",
        ),
        ("lock runs ended by LockLost", len(lock_lost), "holder told, did not write"),
        ("lock overlaps", len(bad_overlaps), ok if not bad_overlaps else "FAIL"),
        (
            "lock overlaps during a Redis reset",
            len(admitted_overlaps),
            "none: no Redis (any repeat fails)" if run.no_redis else "admitted (lock key lost)",
        ),
        ("idempotent keys run", len(idem_by_key), f"of {SIZES.idem_keys}, {load.idem_sent} calls"),
        ("idempotent keys run twice", len(twice_idem), ok if not twice_idem else "FAIL"),
        (
            "idempotent keys twice across a Redis reset",
            len(admitted_idem),
            "none: no Redis (any repeat fails)" if run.no_redis else "admitted (marker lost)",
        ),
        ("idempotent keys twice after a killed run", len(cut_short_idem), "admitted (died before its marker)"),
        *stacked.rows,
        ("processes killed on purpose", len(cluster.killed), ok if not bad_kill else f"FAIL {bad_kill}"),
        ("processes crashed", len(crashed) + len(bad_exit), ok if not (crashed or bad_exit) else "FAIL"),
        (
            "beats exited at startup, coordination unreachable",
            len(cluster.exited_at_startup),
            "documented (fails loudly at startup); started again as a supervisor would",
        ),
        ("unexpected tracebacks", len(bad_tracebacks), ok if not bad_tracebacks else "FAIL"),
        ("unexpected ERROR lines", len(unexpected_errors), ok if not unexpected_errors else "FAIL"),
        (
            "ERROR lines explained by a fault",
            sum(error_causes.values()),
            ", ".join(f"{k} {v}" for k, v in sorted(error_causes.items())),
        ),
        (
            "calls and rows still to end when the faults ended",
            backlog,
            f"all ended {drain_seconds:.0f}s later"
            if drain_ok
            else f"FAIL: {drain_state.get('open_row_count')} rows and more still open after {drain_seconds:.0f}s",
        ),
        (
            "wall time (s)",
            round(time.monotonic() - started_at),
            f"faults {SIZES.fault_phase:g}s, drain {time.monotonic() - fault_end:.0f}s",
        ),
    ]
    report = table(rows_out)
    (tmp_path / "faults-table.md").write_text(report)
    with capsys.disabled():
        print("\n" + report)
        for when, what in faults.events:
            print(f"  {time.strftime('%H:%M:%S', time.localtime(when))} {what}")
    proxy.close()
    direct.close()
    _close_django_connections()  # the restart dropped them; later tests in this process reconnect

    details = {
        "producer/injector errors": load.errors + faults.errors,
        "lost": [
            {
                "id": tid,
                "row": {
                    k: str(getattr(rows.get(tid), k, None))
                    for k in (
                        "status",
                        "due_at",
                        "attempts",
                        "claimed_at",
                        "sent_at",
                        "started_at",
                        "heartbeat_at",
                        "outcome",
                        "starts",
                        "updated_at",
                        "last_error",
                    )
                },
                "cancel_refused": tid in load.cancel_refused,
            }
            for tid in lost[:10]
        ],
        "given_back_lost": {t: delay_runs[t] for t in given_back_lost[:5]},
        "body faults never made": sorted({"reject", "retry", "exit"} - set(given_back.values())) if BODY_FAULTS else [],
        "twice": {t: delay_runs[t] for t in twice_delay[:5]},
        "beside": {t: delay_runs[t] for t in beside[:5]},
        "interrupted_rows": [(r.id, r.worker, str(r.heartbeat_at)) for r in interrupted_rows[:5]],
        "cancelled_ran": cancelled_ran[:10],
        "failed_rows": [(r.id, r.last_error) for r in failed_rows[:5]],
        "unknown_runs": unknown_runs[:10],
        "twice_slots": twice_slots[:10],
        "no_slot_header": no_slot_header[:5],
        "early_delays": sorted(early_delays)[:5],
        "early_slots": sorted(early_slots)[:5],
        "overlaps": bad_overlaps[:5],
        "twice_idem": {k: idem_by_key[k] for k in twice_idem[:5]},
        "crashed": crashed,
        "bad_exit": bad_exit,
        "bad_kill": bad_kill,
        "tracebacks": bad_tracebacks[:10],
        "unexpected_errors": unexpected_errors[:20],
        "sweep_errors_logged": sweep_errors_logged,
        "redis seen": sorted(redis_watch.redis_processes | redis_watch.redis_connections),
        "admitted with no Redis to reset": (admitted_slots + admitted_overlaps + admitted_idem) if run.no_redis else [],
        "redis watch never looked": run.no_redis and redis_watch.samples == 0,
        **stacked.failures,
    }
    failures = {k: v for k, v in details.items() if v and k != "sweep_errors_logged"}
    assert drain_ok, (
        f"the backlog stopped shrinking for {SIZES.drain:g}s or took over {SIZES.drain_cap:g}s\n{report}\n"
        f"{json.dumps(failures, default=str)}\n"
        f"still open at the timeout: {json.dumps(drain_state, default=str)}"
    )
    assert not failures, f"{report}\n{json.dumps(failures, indent=1, default=str)}"
    assert len(load.stored) == SIZES.delays + SIZES.far_delays
    assert len(future) >= SIZES.far_delays - len([t for t in load.cancelled if load.stored[t] > 3600])
    # The PostgreSQL outage was noticed and logged with context: by the sweepers; with the coordination
    # in that database, beat fires no sweep while it is cut, and the beats' own ERROR lines say it.
    noticed = sweep_errors_logged
    if run.no_redis:
        beat_causes = ("beat: coordination PostgreSQL unreachable", "beat: PostgreSQL error in tick")
        noticed += sum(error_causes[cause] for cause in beat_causes)
    assert noticed > 0 or faults.counts["pg-unreachable"] == 0
