"""MemoryLockBackend (the testing plugin's in-process locks) answers as the Redis scripts do.

The same sequence of calls runs against the real ``RedisLockBackend`` on Redis and against the memory one;
the answers must agree, so a user's test of a locked task sees what production would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner, get_lock_backend
from celery_safe_time.locks.backends.redis import RedisLockBackend
from celery_safe_time.testing import MemoryLockBackend

pytestmark = pytest.mark.integration

A = Owner("task-a", "a:1", "host", 1)
A_AGAIN = Owner("task-a", "a:1", "host", 2)  # a redelivered copy of the same delivery
B = Owner("task-b", "b:1", "host", 3)


def _scenario(store: RedisLockBackend) -> list[Any]:
    out: list[Any] = []
    first = store.acquire("k", "tA", 0.5, A)
    out.append((first.status, first.took_over))
    out.append(store.acquire("k", "tB", 5, B).status)  # held
    out.append(store.acquire("k", "tA2", 5, A_AGAIN).status)  # duplicate
    retry = store.acquire("k", "tA3", 5, A, earlier_tokens=("tA",))  # lost reply: ours
    out.append((retry.status, retry.took_over, retry.fence == first.fence))
    out.append(store.renew("k", "wrong", 5))
    out.append(store.renew("k", "tA3", 0.3))
    out.append(store.token_of("k"))
    out.append([i.key for i in store.scan("*")])
    out.append(store.release("k", "wrong"))
    time.sleep(0.5)  # expired
    out.append(store.token_of("k"))
    second = store.acquire("k", "tB", 5, B)
    out.append((second.status, (second.fence or 0) > (first.fence or 0)))
    out.append(store.release("k", "tB", finished=("b:1", 5, "task-b")))
    out.append(store.acquire("k", "tB2", 5, B).status)  # that delivery finished
    # idempotent: a marker, recorded once; a retry of the same commit counts as recorded
    out.append(store.acquire("lock:i", "tI", 5, A, marker="i").status)
    out.append(store.commit("lock:i", "i", "tI", 5, "task-a"))
    out.append(store.commit("lock:i", "i", "tI", 5, "task-a"))
    out.append(store.commit("lock:i", "i", "other", 5, "task-b"))
    out.append(store.acquire("lock:i", "tI2", 5, B, marker="i").status)
    info = store.force_release("k")
    out.append(info)
    return out


def test_memory_lock_store_agrees_with_the_redis_scripts(make_app: Callable[..., Celery]) -> None:
    app = make_app("lock-agreement")
    redis_answers = _scenario(get_lock_backend(app))
    memory_answers = _scenario(MemoryLockBackend(get_config(app)))
    assert memory_answers == redis_answers
    assert redis_answers[0] == ("acquired", False)
    assert redis_answers[1:3] == ["held", "duplicate"]
