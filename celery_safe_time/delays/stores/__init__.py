"""Deprecated: the delayed-task store seam is :mod:`celery_safe_time.delays.backends`.

Kept so that imports of ``celery_safe_time.delays.stores`` (and its ``base``, ``memory`` and ``sql``
modules) keep working; each warns once with :class:`DeprecationWarning`.
"""

from __future__ import annotations

import warnings

from ..backends import DelayStore, create_store, get_store, reset_store, set_store

__all__ = ["DelayStore", "create_store", "get_store", "reset_store", "set_store"]

warnings.warn(
    "celery_safe_time.delays.stores is deprecated; import from celery_safe_time.delays.backends",
    DeprecationWarning,
    stacklevel=2,
)
