"""Durable long delays: ``SafeTask`` stores countdowns beyond the threshold as rows, the sweep publishes them.

The data path of one stored delay: :mod:`.task` (``apply_async`` decides with :mod:`.plan`, encodes
with :mod:`.payload`) -> :mod:`.backends` (the store: one row) -> :mod:`.sweep` (claims it when due;
:mod:`.publish` and, on RabbitMQ, :mod:`.confirms` publish it; :mod:`.maintenance` confirms deliveries
and purges) -> :mod:`.delivery` (the worker runs the delivery once). :mod:`.admin` holds ``cancel``, ``rerun``,
``reschedule`` and the operator views.
"""

from __future__ import annotations

from .admin import cancel, rerun, reschedule
from .task import SafeTask, StoredAsyncResult

__all__ = ["SafeTask", "StoredAsyncResult", "cancel", "rerun", "reschedule"]
