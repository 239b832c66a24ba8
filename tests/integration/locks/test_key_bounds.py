"""Per-key counters on real Redis: they expire, and the fence keeps increasing across that expiry."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from celery import Celery

from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.backends.redis import RedisLockBackend
from tests.helpers.processes import wait_for

KEYS = 300
TTL = 2.0


def test_fence_counters_expire_and_the_fence_keeps_increasing(
    make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    config = get_config(make_app(safe_time_key_prefix="bounds-fence:"))
    store = RedisLockBackend(redis_client, config)
    owner = Owner(task_id="t", identity="t:0:0", host="h", pid=1)
    fences: dict[int, int] = {}
    for n in range(KEYS):  # high-cardinality keys: one account each
        taken = store.acquire(f"sync:{n}", f"tok-{n}", TTL, owner)
        assert taken.status == "acquired"
        assert taken.fence is not None
        fences[n] = taken.fence
        assert store.release(f"sync:{n}", f"tok-{n}")
        # Each counter expires with its lock's ttl. Checked as each lock is released: the 600 round
        # trips of the loop can outlast a ttl on a loaded machine, so a scan after it may not find them all.
        assert 0 < redis_client.pttl(f"bounds-fence:lock-fence:sync:{n}") <= TTL * 1000
    wait_for(lambda: not list(redis_client.scan_iter(match="bounds-fence:lock-fence:*")), timeout=TTL + 10)
    # The counter is gone: the next holder's fence is seeded from the server clock, above the last one.
    again = store.acquire("sync:0", "tok-again", TTL, owner)
    assert again.status == "acquired"
    assert again.fence is not None
    assert again.fence > max(fences.values())


def test_a_held_lock_that_is_renewed_keeps_its_fence_counter(
    make_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    """A holder renews a 0.6 s lock for three times its ttl: the counter lives as long as the lock, so
    the next holder's fence is the next integer, not a fresh seed from the server clock."""
    config = get_config(make_app(safe_time_key_prefix="bounds-renew:"))
    store = RedisLockBackend(redis_client, config)
    owner = Owner(task_id="t", identity="t:0:0", host="h", pid=1)
    first = store.acquire("sync:held", "tok-1", 0.6, owner)
    assert first.status == "acquired"
    assert first.fence is not None
    counter = "bounds-renew:lock-fence:sync:held"
    renewed_until = time.monotonic() + 1.8
    while time.monotonic() < renewed_until:
        time.sleep(0.15)
        assert store.renew("sync:held", "tok-1", 0.6)
        assert redis_client.exists(counter), "the counter expired under a held, renewed lock"
    assert store.release("sync:held", "tok-1")
    second = store.acquire("sync:held", "tok-2", 0.6, owner)
    assert second.status == "acquired"
    assert second.fence == first.fence + 1
