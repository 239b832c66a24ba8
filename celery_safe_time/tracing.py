"""Deprecated alias of :mod:`celery_safe_time.delays.tracing`; it goes in 1.0.

Kept so that ``from celery_safe_time import tracing`` and ``celery_safe_time.tracing.instrument()``
keep working; importing it warns once with :class:`DeprecationWarning`.
"""

from __future__ import annotations

import warnings

from .delays.tracing import ATTRIBUTES, in_stored_context, inject_context, instrument, stored_context, uninstrument

__all__ = ["ATTRIBUTES", "in_stored_context", "inject_context", "instrument", "stored_context", "uninstrument"]

warnings.warn(
    "celery_safe_time.tracing is deprecated; import it from celery_safe_time.delays (from celery_safe_time.delays "
    "import tracing)",
    DeprecationWarning,
    stacklevel=2,
)
