"""Helpers for the beat integration tests: env for ``tests.apps.beat_app`` and run records."""

from __future__ import annotations

import collections
import json
import uuid
from typing import Any

import redis

BEAT_APP = "tests.apps.beat_app"


def beat_env(schedule: dict[str, Any], **conf: Any) -> dict[str, str]:
    return {
        "SAFE_TIME_TEST_BEAT_SCHEDULE": json.dumps(schedule),
        "SAFE_TIME_TEST_APP_CONF": json.dumps(conf),
    }


def runs(client: redis.Redis, label: str | None = None) -> list[dict[str, Any]]:
    """Executions recorded by ``tests.record`` (in order), optionally for one label."""
    out = [json.loads(raw) for raw in client.lrange("test:runs", 0, -1)]
    return [r for r in out if label is None or r["label"] == label]


def slots(client: redis.Redis, label: str) -> list[str]:
    return [r["headers"].get("safe_time_slot") for r in runs(client, label)]


def duplicates(client: redis.Redis, label: str | None = None) -> dict[tuple[str, str], int]:
    """(label, slot) pairs executed more than once."""
    count = collections.Counter((r["label"], r["headers"].get("safe_time_slot")) for r in runs(client, label))
    return {key: n for key, n in count.items() if n > 1}


def leader_pid(client: redis.Redis, prefix: str = "safe_time:") -> int | None:
    raw = client.get(prefix + "beat:leader")
    return int(json.loads(raw)["pid"]) if raw else None


def coordination_settings(postgres_url: str) -> dict[str, str]:
    """App settings for PostgreSQL coordination on ``postgres_url``, under a key prefix of their own
    (so tests sharing the session's database never meet; the prefix is the rows' namespace)."""
    return {"safe_time_coordination_url": postgres_url, "safe_time_key_prefix": f"t{uuid.uuid4().hex[:10]}:"}
