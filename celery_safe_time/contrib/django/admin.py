"""Admin for stored delayed tasks: filter by status and task, search by id and key, cancel action."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages

from ... import constants as C
from .models import DelayedTask
from .store import DjangoStore


@admin.register(DelayedTask)
class DelayedTaskAdmin(admin.ModelAdmin):
    list_display = ("id", "task", "status", "due_at", "outcome", "worker", "starts", "updated_at", "last_error")
    list_filter = ("status", "outcome", "task")
    search_fields = ("id", "idempotency_key")
    ordering = ("due_at", "id")
    date_hierarchy = "due_at"
    exclude = ("payload",)
    readonly_fields = (
        "id",
        "task",
        "payload_size",
        "content_type",
        "content_encoding",
        "due_at",
        "expires_at",
        "status",
        "idempotency_key",
        "attempts",
        "created_at",
        "updated_at",
        "claimed_at",
        "claim_token",
        "sent_at",
        "last_error",
        "delivery_token",
        "started_at",
        "heartbeat_at",
        "finished_at",
        "outcome",
        "worker",
        "started_by",
        "starts",
    )
    actions = ["cancel_pending"]

    def has_add_permission(self, request: Any) -> bool:
        # Rows come from SafeTask.apply_async; a hand-made payload would be a corrupt call.
        return False

    @admin.display(description="payload bytes")
    def payload_size(self, obj: DelayedTask) -> int:
        return len(bytes(obj.payload or b""))

    @admin.action(description="Cancel selected delayed tasks that have not started")
    def cancel_pending(self, request: Any, queryset: Any) -> None:
        store = DjangoStore(using=queryset.db)
        ids = list(queryset.filter(status__in=sorted(C.DELAY_CANCELLABLE_STATUSES)).values_list("id", flat=True))
        from ... import signals

        cancelled = 0
        for task_id in ids:
            if store.cancel(task_id):
                cancelled += 1
                signals.delay_cancelled.send(sender=store, task_id=task_id)
        self.message_user(request, f"Cancelled {cancelled} delayed task(s) that had not started.", messages.SUCCESS)
