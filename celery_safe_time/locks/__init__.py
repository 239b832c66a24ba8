"""Per-key locks around task bodies: ``@overlap_lock`` (one run at a time per key) and ``@idempotent``
(one successful run per key and window), and flow control per key: ``@rate_limit`` and
``@concurrency_limit`` (:mod:`.limits`, the sliding log in :mod:`.rates`).

:mod:`.runtime` takes, holds and releases a lock around one call; :mod:`.backends` holds the locks
(one module per backend: Redis with the Lua scripts in ``lua/``, PostgreSQL, in-process memory);
:mod:`.watchdog` renews a lock while the body runs; :mod:`.hard_limit` frees it after a hard time
limit; :mod:`.keys` renders key templates; :mod:`.admin` is the operator view.
"""

from __future__ import annotations

from .idempotency import idempotent
from .limits import concurrency_limit, rate_limit
from .overlap import current_fence, current_lock, overlap_lock

__all__ = ["concurrency_limit", "current_fence", "current_lock", "idempotent", "overlap_lock", "rate_limit"]
