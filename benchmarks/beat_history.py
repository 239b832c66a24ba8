"""What the run history costs a beat tick: the guarded dispatch round trip (``write_slots``) with the
history on (each slot's record written in the same script / statement) and off, on Redis and on
PostgreSQL coordination. Batches of 1 and of 100 due entries, each entry's history full (trimmed on
every write), medians of many rounds.

    python -m benchmarks.beat_history [--rounds N] [--redis URL] [--postgres URL]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

from celery import Celery

from celery_safe_time.beat import history
from celery_safe_time.beat.backends import BeatBackend, SlotWrite, beat_backend
from celery_safe_time.beat.state import dump_state
from celery_safe_time.config import get_config


def _backend(redis_url: str, postgres_url: str | None, size: int) -> BeatBackend:
    app = Celery("bench-history", set_as_current=False)
    conf: dict[str, Any] = {
        "broker_url": "memory://",
        "safe_time_redis_url": redis_url,
        "safe_time_key_prefix": f"bench-{uuid.uuid4().hex[:8]}:",
        "safe_time_beat_history_size": size,
    }
    if postgres_url:
        conf["safe_time_coordination_url"] = postgres_url
    app.conf.update(conf)
    backend = beat_backend(get_config(app))
    backend.startup_checks("bench")
    return backend


def _round(backend: BeatBackend, lease: Any, epoch: int, batch: int, slot: float, size: int) -> float:
    writes = [
        SlotWrite(f"e{i}", dump_state(slot, slot + 1, "sig"), slot + 1, slot) for i in range(batch)
    ]  # fmt: skip
    writes, _ = history.stamp_writes(writes, epoch, slot, size)
    started = time.perf_counter()
    verdicts = lease.write_slots(epoch, writes)
    elapsed = time.perf_counter() - started
    assert all(v == 1 for v in verdicts), verdicts
    return elapsed


class Bench:
    """One backend, its lease and its next slot, each entry's history filled (every later write trims)."""

    def __init__(self, redis_url: str, postgres_url: str | None, batch: int, size: int) -> None:
        self.backend = _backend(redis_url, postgres_url, size)
        self.lease = self.backend.make_lease()
        epoch = self.lease.acquire(time.time())
        assert epoch is not None
        self.epoch, self.batch, self.size = epoch, batch, size
        self.slot = 1_800_000_000.0
        self.times: list[float] = []
        for _ in range(max(size, 1) + 5):
            self.round(keep=False)

    def round(self, keep: bool = True) -> None:
        elapsed = _round(self.backend, self.lease, self.epoch, self.batch, self.slot, self.size)
        self.slot += 1
        if keep:
            self.times.append(elapsed)

    def close(self) -> float:
        """Median milliseconds of one ``write_slots``; drops what the run wrote (Redis keys)."""
        self.lease.release()
        client = getattr(self.backend, "client", None)
        if client is not None:  # PostgreSQL rows stay under their own ns
            for key in client.scan_iter(match=self.backend.config.key_prefix + "*", count=1000):
                client.delete(key)
        self.backend.close()
        return statistics.median(self.times) * 1000 if self.times else 0.0


def measure(redis_url: str, postgres_url: str | None, batch: int, rounds: int) -> tuple[float, float]:
    """Median milliseconds of one ``write_slots`` of ``batch`` dispatches, history off and on (50 kept),
    their rounds interleaved so that a load change on the machine hits both alike."""
    off, on = Bench(redis_url, postgres_url, batch, 0), Bench(redis_url, postgres_url, batch, 50)
    for _ in range(rounds):
        off.round()
        on.round()
    return off.close(), on.close()


def measure_outcome(redis_url: str, postgres_url: str | None, rounds: int) -> float:
    """Median milliseconds of the worker's outcome write (``history_outcome``) of one run."""
    bench = Bench(redis_url, postgres_url, 1, 50)
    outcome = json.dumps({"outcome": "succeeded", "finished": time.time(), "runtime": 0.01})
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        bench.backend.history_outcome("e0", bench.slot - 1, outcome)
        times.append(time.perf_counter() - started)
    bench.close()
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args(argv)
    print("| backend | due entries per tick | history off (ms) | history on, 50 kept (ms) | cost |")
    print("|---|---|---|---|---|")
    for label, pg in (("Redis", None), ("PostgreSQL", args.postgres)):
        for batch in (1, 100):
            rounds = args.rounds if batch == 1 else max(args.rounds // 5, 10)
            off, on = measure(args.redis, pg, batch, rounds)
            print(f"| {label} | {batch} | {off:.3f} | {on:.3f} | {on - off:+.3f} ms ({(on / off - 1) * 100:+.0f}%) |")
    print()
    print("| backend | the worker's outcome write per beat-published task (ms) |")
    print("|---|---|")
    for label, pg in (("Redis", None), ("PostgreSQL", args.postgres)):
        print(f"| {label} | {measure_outcome(args.redis, pg, args.rounds):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
