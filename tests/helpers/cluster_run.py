"""A Safe Beat run whose lease lives on a test cluster (two ``celery beat`` processes and a worker), and
the checks the cluster and Sentinel fault tests share: one leader at a time, no slot run twice."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis

from celery_safe_time import constants as C
from celery_safe_time.config import SafeTimeConfig
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.backends.redis import RedisLockBackend
from tests.helpers.beat import BEAT_APP, beat_env, runs
from tests.helpers.processes import CeleryProcess, ProcessManager, wait_for

LEASE = 4.0
SCHEDULE = {"fast": {"task": "tests.record", "every": 1, "args": ["fast"]}}


def slot_of(run: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(run["headers"]["safe_time_slot"])).timestamp()


def start_beats(processes: ProcessManager, url: str, n: int = 2) -> list[CeleryProcess]:
    env = beat_env(SCHEDULE, safe_time_beat_lease=LEASE, safe_time_redis_url=url)
    processes.worker(BEAT_APP, env=env, name="worker")
    return [processes.beat(BEAT_APP, env=env, name=f"beat{i}") for i in range(n)]


def leader_pid(client: redis.Redis, config: SafeTimeConfig) -> int | None:
    try:
        raw = client.get(config.key(C.KEY_BEAT_LEADER_INFO))
    except redis.RedisError:
        return None
    return int(json.loads(raw)["pid"]) if raw else None


def _epoch(run: dict[str, Any]) -> int:
    return int(run["headers"]["safe_time_epoch"])


def one_leader_at_a_time(records: list[dict[str, Any]]) -> None:
    """In slot order the epochs never go back: no slot published by an earlier leader after a later
    one took over (two leaders interleaving would show as a step back)."""
    ordered = sorted(records, key=slot_of)
    epochs = [int(r["headers"]["safe_time_epoch"]) for r in ordered]
    steps_back = [(slot_of(a), slot_of(b)) for a, b in itertools.pairwise(ordered) if _epoch(b) < _epoch(a)]
    assert not steps_back, f"an earlier leader published after a later one: {steps_back[:5]} (epochs {epochs})"


@dataclass
class LockContenders:
    """Two threads taking one lock in turn (hold 0.2 s, release): every hold is recorded as
    (start, end) in Redis TIME so overlaps can be counted. Errors (a failover) are counted, not fatal."""

    store: RedisLockBackend
    key: str
    ttl: float = 5.0
    holds: list[tuple[float, float, str]] = field(default_factory=list)
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _now(self) -> float:
        seconds, micros = self.store.client.time()
        return float(seconds) + float(micros) / 1e6

    def _run(self, name: str) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            token = f"{name}-{n}"
            owner = Owner(task_id=token, identity=f"{token}:0:0", host="test", pid=n)
            try:
                got = self.store.acquire(self.key, token, self.ttl, owner)
                if got.status != "acquired":
                    time.sleep(0.02)
                    continue
                start = self._now()
                time.sleep(0.2)
                end = self._now()
                self.store.release(self.key, token)
                self.holds.append((start, end, token))
            except (redis.RedisError, OSError):
                self.errors += 1
                time.sleep(0.2)

    def start(self) -> LockContenders:
        for name in ("a", "b"):
            thread = threading.Thread(target=self._run, args=(name,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def overlaps(self) -> list[tuple[str, str]]:
        ordered = sorted(self.holds)
        return [(a[2], b[2]) for a, b in itertools.pairwise(ordered) if b[0] < a[1]]


def wait_runs(client: redis.Redis, more_than: int, timeout: float = 60) -> None:
    wait_for(lambda: len(runs(client)) > more_than, timeout, message=f"more than {more_than} runs")
