"""Every publish carries a fresh ``safe_time_attempt`` token; a copied header never survives a re-publish."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from celery_safe_time import constants as C
from celery_safe_time.messages import requeue  # noqa: F401 - connects the publish hook

pytestmark = pytest.mark.integration


def test_each_publish_gets_a_new_attempt_token(make_app: Any, redis_client: redis.Redis) -> None:
    app = make_app()

    @app.task(name="attempt.t")
    def t() -> None: ...

    t.apply_async(headers={C.HEADER_ATTEMPT: "copied-from-a-request"})
    t.apply_async()
    t.apply_async(countdown=5)
    messages = [json.loads(raw) for raw in redis_client.lrange("celery", 0, -1)]
    tokens = [m["headers"][C.HEADER_ATTEMPT] for m in messages]
    assert len(tokens) == 3
    assert len(set(tokens)) == 3
    assert "copied-from-a-request" not in tokens
