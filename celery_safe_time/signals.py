"""Signals sent by celery-safe-time (``celery.utils.dispatch.Signal``, connect as usual).

Every signal is sent with ``sender`` set to the object that acted (scheduler, task, store)
and the keyword arguments listed beside it.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "beat_lease_acquired",
    "beat_lease_lost",
    "beat_slot_dispatched",
    "beat_slot_duplicate",
    "delay_cancelled",
    "delay_debounced",
    "delay_delivery_skipped",
    "delay_failed",
    "delay_released",
    "delay_stored",
    "idempotent_skipped",
    "idempotent_unrecorded",
    "overlap_conflict",
    "overlap_lock_lost",
    "rate_limit_admitted",
    "rate_limited",
    "unique_conflict",
]

#: A beat became leader. kwargs: epoch, lease (seconds).
beat_lease_acquired = Signal(name="beat_lease_acquired", providing_args={"epoch", "lease"})
#: A leader lost its lease and is a standby now. kwargs: epoch, reason.
beat_lease_lost = Signal(name="beat_lease_lost", providing_args={"epoch", "reason"})
#: A slot was published. kwargs: entry, slot (aware UTC datetime), epoch, task_id.
beat_slot_dispatched = Signal(name="beat_slot_dispatched", providing_args={"entry", "slot", "epoch", "task_id"})
#: A slot was not published because it was already fired (or the lease was gone). kwargs: entry, slot, reason.
beat_slot_duplicate = Signal(name="beat_slot_duplicate", providing_args={"entry", "slot", "reason"})
#: A long delay was written to the store instead of the broker. kwargs: task_id, task_name, due_at.
delay_stored = Signal(name="delay_stored", providing_args={"task_id", "task_name", "due_at"})
#: A debounced call merged into its key's pending row (moved its due time, replaced its arguments).
#: kwargs: task_id (the row's), task_name, key, due_at (the row's new due time).
delay_debounced = Signal(name="delay_debounced", providing_args={"task_id", "task_name", "key", "due_at"})
#: A stored delay was published by the sweep. kwargs: task_id, task_name, due_at.
delay_released = Signal(name="delay_released", providing_args={"task_id", "task_name", "due_at"})
#: A stored delay was cancelled. kwargs: task_id.
delay_cancelled = Signal(name="delay_cancelled", providing_args={"task_id"})
#: A worker dropped a copy of a stored delivery: it already ran, was cancelled, or is stale.
#: kwargs: task_id, reason (``done``, ``superseded``, ``missing``).
delay_delivery_skipped = Signal(name="delay_delivery_skipped", providing_args={"task_id", "reason"})
#: A stored delay could not be published and was marked failed. kwargs: task_id, task_name, error.
delay_failed = Signal(name="delay_failed", providing_args={"task_id", "task_name", "error"})
#: A task did not run because its overlap lock was held. kwargs: key, task_id, holder, action.
overlap_conflict = Signal(name="overlap_conflict", providing_args={"key", "task_id", "holder", "action"})
#: A running task's overlap lock could not be renewed. kwargs: key, task_id.
overlap_lock_lost = Signal(name="overlap_lock_lost", providing_args={"key", "task_id"})
#: An idempotent task did not run because its key already ran. kwargs: key, task_id.
idempotent_skipped = Signal(name="idempotent_skipped", providing_args={"key", "task_id"})
#: An idempotent task's body returned but its marker could not be written (the lock backend unreachable
#: through every commit retry): a later call of the key would run it again. kwargs: key, task_id, error.
idempotent_unrecorded = Signal(name="idempotent_unrecorded", providing_args={"key", "task_id", "error"})
#: A unique task was not queued because its key was held. kwargs: key, task_id (the holder), state.
unique_conflict = Signal(name="unique_conflict", providing_args={"key", "task_id", "state"})
#: A ``rate_limit``ed call found its limit full and was re-queued to when it frees. kwargs: key, task_id,
#: task_name, wait (seconds until the limit frees), countdown (the re-queue's, jitter included).
rate_limited = Signal(name="rate_limited", providing_args={"key", "task_id", "task_name", "wait", "countdown"})
#: A ``rate_limit``ed call was admitted. kwargs: key, task_id, task_name, lateness (seconds since it
#: first found its limit full; 0.0 when it never did), started_at (its start as the limit recorded it:
#: epoch seconds on the lock backend's clock).
rate_limit_admitted = Signal(
    name="rate_limit_admitted", providing_args={"key", "task_id", "task_name", "lateness", "started_at"}
)
