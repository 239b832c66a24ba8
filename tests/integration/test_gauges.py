"""The scrape-time gauges, read through a real HTTP scrape of prometheus_client's endpoint."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from celery_safe_time.beat.backends.redis import Lease
from celery_safe_time.clock import local_time
from celery_safe_time.config import get_config
from celery_safe_time.delays.backends import get_store
from celery_safe_time.delays.backends.base import NewDelay
from celery_safe_time.locks.backends import Owner, get_lock_backend
from celery_safe_time.metrics import GAUGES, register_gauges
from celery_safe_time.redis_client import get_redis

pytestmark = pytest.mark.integration


@pytest.fixture
def scrape() -> Iterator[Callable[[CollectorRegistry], dict[tuple[str, tuple[tuple[str, str], ...]], float]]]:
    servers: list[object] = []

    def do(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        if not servers:
            server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
            servers.append((server, thread))
        server = servers[0][0]  # type: ignore[index]
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    yield do
    for server, thread in servers:  # type: ignore[misc]
        server.shutdown()
        server.server_close()
        thread.join(5)


def _delay(task_id: str, due_in: float, store: object) -> NewDelay:
    return NewDelay(
        id=task_id,
        task="tests.record",
        payload=b'{"args": [], "kwargs": {}, "options": {}}',
        content_type="application/json",
        content_encoding="utf-8",
        due_at=store.now() + timedelta(seconds=due_in),  # type: ignore[attr-defined]
    )


def test_gauges_follow_the_store_the_lease_and_the_locks_on_scrape(make_app: Callable[..., Celery], scrape) -> None:  # type: ignore[no-untyped-def]
    app = make_app("gauges")
    registry = CollectorRegistry()
    register_gauges(app, registry)

    empty = scrape(registry)
    assert empty[("safe_time_delays", (("status", "pending"),))] == 0
    assert empty[("safe_time_delay_oldest_due_lateness_seconds", ())] == 0
    assert empty[("safe_time_beat_leader", (("host", ""), ("pid", "")))] == 0
    assert empty[("safe_time_overlap_locks_held", ())] == 0
    assert empty[("safe_time_gauge_source_up", (("source", "store"),))] == 1
    assert empty[("safe_time_gauge_source_up", (("source", "redis"),))] == 1

    store = get_store(app)
    store.insert(_delay("late", -40, store))
    store.insert(_delay("later", 3600, store))
    store.insert(_delay("broken", -5, store))
    assert {r.id for r in store.claim_due(limit=10, lookahead=0, token="t")} == {"late", "broken"}
    store.mark_failed("broken", "t", "boom")
    store.release(["late"], "t")  # back to pending, 40 s overdue
    lease = Lease(get_redis(get_config(app).redis_url), get_config(app), info={"host": "beat-1", "pid": 4242})
    epoch = lease.acquire(local_time())
    assert epoch is not None
    locks = get_lock_backend(app)
    locks.acquire("sync:1", "tok1", 60, Owner("t1", "t1:1", "h", 1))
    locks.acquire("sync:2", "tok2", 60, Owner("t2", "t2:1", "h", 1))

    seen = scrape(registry)  # computed now, at this scrape: nothing was counted per event
    assert seen[("safe_time_delays", (("status", "pending"),))] == 2
    assert seen[("safe_time_delays", (("status", "failed"),))] == 1
    assert seen[("safe_time_delays", (("status", "claimed"),))] == 0
    assert seen[("safe_time_delay_oldest_due_lateness_seconds", ())] == pytest.approx(40, abs=5)
    assert ("safe_time_delay_oldest_due_timestamp_seconds", ()) in seen
    assert seen[("safe_time_beat_leader", (("host", "beat-1"), ("pid", "4242")))] == 1
    assert 0 < seen[("safe_time_beat_lease_remaining_seconds", ())] <= get_config(app).beat_lease
    assert seen[("safe_time_beat_epoch", ())] == epoch
    assert seen[("safe_time_overlap_locks_held", ())] == 2

    lease.release()
    locks.release("sync:1", "tok1")
    after = scrape(registry)
    assert after[("safe_time_beat_leader", (("host", ""), ("pid", "")))] == 0
    assert after[("safe_time_beat_lease_remaining_seconds", ())] == 0
    assert after[("safe_time_overlap_locks_held", ())] == 1
    # Every gauge this module documents is exported (the oldest-due timestamp is present while one is pending).
    names = {name for name, _ in after}
    assert set(GAUGES) <= names


def test_a_down_store_or_redis_is_reported_not_raised(make_app: Callable[..., Celery], scrape) -> None:  # type: ignore[no-untyped-def]
    app = make_app(
        "gauges-down",
        safe_time_store_url="postgresql+psycopg://app:s3cret@127.0.0.1:1/nope",
        safe_time_redis_url="redis://127.0.0.1:1/0",
    )
    registry = CollectorRegistry()
    register_gauges(app, registry)
    seen = scrape(registry)
    assert seen[("safe_time_gauge_source_up", (("source", "store"),))] == 0
    assert seen[("safe_time_gauge_source_up", (("source", "redis"),))] == 0
    assert ("safe_time_delays", (("status", "pending"),)) not in seen
