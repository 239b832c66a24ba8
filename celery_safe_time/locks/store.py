"""Deprecated: the lock backend seam is :mod:`celery_safe_time.locks.backends`.

Kept so that imports of ``celery_safe_time.locks.store`` keep working; importing it warns once with
:class:`DeprecationWarning`. ``get_lock_store`` / ``use_lock_store`` are
:func:`~celery_safe_time.locks.backends.get_lock_backend` / ``use_lock_backend``, and ``LockStore`` /
``RedisLockStore`` are :class:`~celery_safe_time.locks.backends.redis.RedisLockBackend`.
"""

from __future__ import annotations

import warnings

from .backends import (
    Acquired,
    AcquireStatus,
    Holder,
    HolderRecord,
    LockBackend,
    LockInfo,
    Owner,
    UniqueClaim,
    UniqueStatus,
)
from .backends import get_lock_backend as get_lock_store
from .backends import use_lock_backend as use_lock_store
from .backends.redis import SCRIPTS, RedisLockBackend

LockStore = RedisLockStore = RedisLockBackend

__all__ = [
    "SCRIPTS",
    "AcquireStatus",
    "Acquired",
    "Holder",
    "HolderRecord",
    "LockBackend",
    "LockInfo",
    "LockStore",
    "Owner",
    "RedisLockStore",
    "UniqueClaim",
    "UniqueStatus",
    "get_lock_store",
    "use_lock_store",
]

warnings.warn(
    "celery_safe_time.locks.store is deprecated; import from celery_safe_time.locks.backends",
    DeprecationWarning,
    stacklevel=2,
)
