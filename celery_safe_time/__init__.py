"""celery-safe-time: "run later" that means the same thing on every machine of a Celery deployment.

Single-leader Beat with per-slot dedupe, durable long delays, per-key overlap locks,
idempotency keys and DST-correct crontabs. See README.md.
"""

from __future__ import annotations

from . import exceptions, signals
from .config import SafeTimeConfig, get_config
from .install import install

__version__ = "0.1.0"

__all__ = [
    "SafeTimeConfig",
    "exceptions",
    "get_config",
    "install",
    "signals",
]
