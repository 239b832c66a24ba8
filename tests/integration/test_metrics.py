"""Prometheus counters follow the package's signals on real operations."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_safe_time import cancel, install, reschedule
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.metrics import disable_metrics, enable_metrics
from tests.apps.delays_tasks import define_tasks

pytestmark = pytest.mark.integration


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    enable_metrics(registry)
    yield registry
    disable_metrics()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_counters_follow_stored_cancelled_and_released_delays(
    make_app: Callable[..., Celery], registry: CollectorRegistry
) -> None:
    app = make_app("metrics", safe_time_delay_threshold=60)
    install(app)
    tasks = define_tasks(app)
    task = next(iter(tasks.values()))
    kept = task.apply_async(("kept",), countdown=3600)
    dropped = task.apply_async(("dropped",), countdown=3600)
    assert value(registry, "safe_time_delays_stored_total", task_name=task.name) == 2
    assert cancel(dropped.id, app=app)
    assert value(registry, "safe_time_delays_cancelled_total") == 1
    assert reschedule(kept.id, countdown=0, app=app)
    sweep(app)
    assert value(registry, "safe_time_delays_released_total", task_name=task.name) == 1


def test_enable_twice_is_a_no_op(registry: CollectorRegistry) -> None:
    again = enable_metrics(registry)
    assert "safe_time_delays_stored_total" in again


def test_debounced_calls_merged_are_counted(make_app: Callable[..., Celery], registry: CollectorRegistry) -> None:
    app = make_app("metrics-debounce")
    install(app)
    task = define_tasks(app)["add"]
    for y in range(4):
        task.apply_async((1, y), debounce=30, debounce_key="site:{x}", debounce_max_wait=300)
    task.apply_async((2, 0), debounce=30, debounce_key="site:{x}")
    assert value(registry, "safe_time_delays_stored_total", task_name=task.name) == 2
    assert value(registry, "safe_time_delays_debounced_total", task_name=task.name) == 3
