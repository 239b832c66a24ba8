"""The short scheduler names registered as ``celery.beat_schedulers`` entry points."""

from __future__ import annotations

import pytest
import redis
from celery.utils.imports import load_extension_class_names, symbol_by_name

from celery_safe_time import SafeScheduler
from celery_safe_time.contrib.django import SafeDatabaseScheduler
from tests.helpers.beat import BEAT_APP, beat_env, leader_pid, runs
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def test_aliases_resolve_to_the_schedulers() -> None:
    aliases = dict(load_extension_class_names("celery.beat_schedulers"))
    assert symbol_by_name("safe", aliases=aliases) is SafeScheduler
    assert symbol_by_name("safe_django", aliases=aliases) is SafeDatabaseScheduler


def test_beat_dash_s_safe_runs_the_safe_scheduler(processes: ProcessManager, redis_client: redis.Redis) -> None:
    schedule = {"every-second": {"task": "tests.record", "every": 1, "args": ["alias"]}}
    env = beat_env(schedule, safe_time_beat_lease=6)
    processes.worker(BEAT_APP, env=env, name="worker")
    beat = processes.beat(BEAT_APP, env=env, name="beat", scheduler="safe")
    wait_for(lambda: leader_pid(redis_client) == beat.pid, 60, message="the -S safe beat to lead")
    wait_for(lambda: len(runs(redis_client, "alias")) >= 2, 60, message="runs from the -S safe beat")
    assert all(r["headers"].get("safe_time_slot") for r in runs(redis_client, "alias"))
