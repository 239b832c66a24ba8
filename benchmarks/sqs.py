"""SQS on a local SQS-compatible endpoint (moto's server mode) this run starts, in one run:

1. Executions of a countdown longer than the visibility timeout, a SafeTask vs a plain task on the
   same two workers (``benchmarks.safety.bench_visibility`` on SQS), and the lateness of the stored
   calls (start minus due time): the burst due at once and a spread due one by one.
2. The sweep's publish rate to SQS (``SendMessageBatch``, 10 a call) next to a raw kombu publish of the
   same task messages to the same endpoint (one ``SendMessage`` each), taken before and after it.
3. A beat leader's ticks publishing a burst of runtime entries due at the same minute to SQS: batched
   (``SendMessageBatch``) next to one ``SendMessage`` per slot (the same leader code with batching
   off), taken before and after it.

The endpoint is a Python process on this machine: its rates and latencies say how the package's SQS
path compares with kombu's on the same endpoint, not what real SQS (network round trips, regional
quotas) gives. ``python -m benchmarks.sqs [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

from celery import Celery
from kombu import Connection, Producer

import celery_safe_time.beat.scheduler as beat_scheduler
from benchmarks.delays import Env, _seed_due
from benchmarks.safety import bench_visibility
from celery_safe_time import save_entries
from celery_safe_time.delays.backends import reset_store
from celery_safe_time.delays.sweep import sweep
from tests.helpers import services
from tests.helpers.beat import burst_cron, burst_hour, leader_at_burst

QUEUE = "celery"


def _held(endpoint: services.SqsEndpoint, prefix: str) -> int:
    """How many messages the run's queue under ``prefix`` holds."""
    client = endpoint.client()
    url = client.get_queue_url(QueueName=f"{prefix}{QUEUE}")["QueueUrl"]
    attributes = client.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


def _raw_publish(endpoint: services.SqsEndpoint, transport: dict[str, Any], app: Celery, n: int) -> float:
    """Raw kombu publish rate of the same task messages (built beforehand, only the publish timed), to
    a queue of its own (SQS allows one purge a minute: each phase fills a fresh queue instead)."""
    due = datetime.now(timezone.utc)
    messages = [app.amqp.create_task_message(f"raw-{i}", "tests.delays.record", ("x",), {}, eta=due) for i in range(n)]
    with Connection(endpoint.url, transport_options=transport) as conn:
        producer = Producer(conn.default_channel)
        conn.SimpleQueue(QUEUE).close()  # the queue exists, as a worker would have it
        started = time.perf_counter()
        for headers, properties, body, _ in messages:
            producer.publish(body, routing_key=QUEUE, headers=headers, serializer="json", **properties)
        rate = n / (time.perf_counter() - started)
    assert _held(endpoint, transport["queue_name_prefix"]) == n
    return rate


def bench_sweep_sqs(env: Env, endpoint: services.SqsEndpoint, n: int) -> dict[str, Any]:
    """One sweep of ``n`` due rows to SQS, between two raw kombu publishes of ``n`` messages."""
    transport = services.sqs_transport_options("bench-sweep-")
    app = env.app(endpoint.url, broker_transport_options=transport, safe_time_sweep_batch=500)
    raw = [_raw_publish(endpoint, services.sqs_transport_options("bench-raw1-"), app, n)]
    store = _seed_due(env, n)
    started = time.perf_counter()
    stats = sweep(app)
    rate = stats.sent / (time.perf_counter() - started)
    assert stats.sent == n, stats
    queued = _held(endpoint, transport["queue_name_prefix"])
    assert queued == n, (queued, n)
    reset_store(app)
    store.close()
    raw.append(_raw_publish(endpoint, services.sqs_transport_options("bench-raw2-"), app, n))
    return {
        "rows": n,
        "sweep_per_s": rate,
        # The machine is shared: the baseline is the mean of runs taken right before and after the sweep.
        "raw_kombu_runs": raw,
        "raw_kombu_per_s": statistics.mean(raw),
    }


def _noop(*args: Any) -> None:
    return None


def _beat_burst(env: Env, endpoint: services.SqsEndpoint, n: int, batched: bool, phase: str) -> float:
    """Seconds from the burst until a leader has published ``n`` entries due then to SQS (each slot in the
    queue once); ``batched`` False: the leader publishes one ``SendMessage`` per slot."""
    transport = services.sqs_transport_options(f"bench-beat-{phase}-")
    env.redis.flushdb()
    app = env.app(endpoint.url, broker_transport_options=transport, safe_time_beat_lease=30, beat_schedule={})
    app.task(name="bench.sqs_burst", shared=False)(_noop)
    hour = burst_hour(time.time())
    cron = burst_cron(hour)
    save_entries([{"name": f"t-{i}", "task": "bench.sqs_burst", "schedule": cron} for i in range(n)], app=app)
    real = beat_scheduler.publishes_in_batches
    if not batched:
        beat_scheduler.publishes_in_batches = lambda producer: False  # type: ignore[assignment]
    try:
        (env.tmp / phase).mkdir()
        sched, burst = leader_at_burst(app, env.tmp / phase, hour)
        try:
            while sched.clock.time() < burst:
                time.sleep(0.001)
            started = time.perf_counter()
            sched.tick()  # the first publish creates the queue
            while _held(endpoint, transport["queue_name_prefix"]) < n:
                sched.tick()
            took = time.perf_counter() - started
        finally:
            sched.close()
    finally:
        beat_scheduler.publishes_in_batches = real
        app.close()
    return took


def bench_beat_sqs(env: Env, endpoint: services.SqsEndpoint, n: int) -> dict[str, Any]:
    """The burst batched, between two runs of one ``SendMessage`` per slot."""
    unbatched = [_beat_burst(env, endpoint, n, False, "one1")]
    batched = _beat_burst(env, endpoint, n, True, "batch")
    unbatched.append(_beat_burst(env, endpoint, n, False, "one2"))
    return {
        "entries": n,
        "batched_s": batched,
        "one_by_one_runs_s": unbatched,
        "one_by_one_s": statistics.mean(unbatched),
    }


def run(quick: bool) -> dict[str, Any]:
    endpoint = services.SqsEndpoint().start()
    results: dict[str, Any] = {"quick": quick}
    try:
        env = Env()
        try:
            results["sweep"] = bench_sweep_sqs(env, endpoint, 200 if quick else 1_000)
            results["beat"] = bench_beat_sqs(env, endpoint, 100 if quick else 1_000)
        finally:
            env.close()
        results["visibility"] = bench_visibility(quick, broker="sqs", endpoint=endpoint, spread=10 if quick else 40)
    finally:
        endpoint.stop()
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| measurement | celery-safe-time | baseline (same run, same endpoint) | ratio |", "|---|---|---|---|"]
    v = results.get("visibility")
    if v:
        lines.append(
            f"| executions per task, countdown {v['countdown_s']:g} s > visibility_timeout "
            f"{v['visibility_timeout_s']:g} s ({v['tasks']} tasks each, 2 workers) "
            f"| mean {v['safe_mean']:.2f}, max {v['safe_max']}, {v['safe_missing']} lost (SafeTask) "
            f"| plain Celery: mean {v['plain_mean']:.2f}, max {v['plain_max']} | - |"
        )
        if v.get("lateness_samples"):
            lines.append(
                f"| stored-call lateness (start - due), {v['lateness_samples']} calls: {v['tasks']} due at once, "
                f"{v['spread_tasks']} spread | p50 {v['lateness_p50_s']:.2f} s, p99 {v['lateness_p99_s']:.2f} s, "
                f"max {v['lateness_max_s']:.2f} s | - | - |"
            )
    s = results.get("sweep")
    if s:
        ratio = s["sweep_per_s"] / s["raw_kombu_per_s"] if s["raw_kombu_per_s"] else float("nan")
        lines.append(
            f"| sweep publish to SQS, {s['rows']:,} due rows (SendMessageBatch, 10 a call) "
            f"| {s['sweep_per_s']:.0f} rows/s | raw kombu publish of the same messages (SendMessage each): "
            f"{s['raw_kombu_per_s']:.0f} msg/s | {ratio:.2f}x |"
        )
    b = results.get("beat")
    if b:
        lines.append(
            f"| beat burst to SQS, {b['entries']:,} entries due at the same minute, from it to the last publish "
            f"| {b['batched_s']:.2f} s (SendMessageBatch, 10 a call) "
            f"| one SendMessage per slot: {b['one_by_one_s']:.2f} s "
            f"({', '.join(f'{x:.2f}' for x in b['one_by_one_runs_s'])}) "
            f"| {b['one_by_one_s'] / b['batched_s']:.2f}x faster |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    results = run(args.quick)
    print(table(results))
    print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
