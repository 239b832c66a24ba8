"""A process that holds one lock until it is killed: ``benchmarks/locks.py`` kills it with SIGKILL
and times how long until another process can take the lock.

``python -m benchmarks.locks_holder <redis|lease|session> <url> <key> <ttl>`` acquires ``key`` with
``ttl`` and renews it every ``ttl/3``, as the watchdog does; prints ``held`` once it holds it.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

from celery import Celery

from celery_safe_time.locks.backends import LockBackend, Owner, get_lock_backend


def store_for(kind: str, url: str) -> LockBackend:
    """The lock store of ``kind`` (``redis``: ``url`` is a Redis URL; ``lease``/``session``: PostgreSQL)."""
    app = Celery(f"bench-holder-{kind}", broker="memory://", set_as_current=False)
    if kind == "redis":
        app.conf.update(safe_time_redis_url=url)
    else:
        app.conf.update(safe_time_coordination_url=url, safe_time_coordination_locks=kind)
    return get_lock_backend(app)


def main(argv: list[str]) -> int:
    kind, url, key, ttl_text = argv
    ttl = float(ttl_text)
    store = store_for(kind, url)
    token = uuid.uuid4().hex
    owner = Owner(task_id=f"holder-{os.getpid()}", identity=f"holder-{os.getpid()}:0:0", host="bench", pid=os.getpid())
    acquired = store.acquire(key, token, ttl, owner)
    if acquired.status != "acquired":
        print(f"not acquired: {acquired.status}", flush=True)
        return 1
    print("held", flush=True)
    while True:
        time.sleep(ttl / 3.0)
        store.renew(key, token, ttl)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
