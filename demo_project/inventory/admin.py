from __future__ import annotations

from django.contrib import admin

from .models import SyncRun


@admin.register(SyncRun)
class SyncRunAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("account_id", "started", "finished", "slot", "task_id")
    list_filter = ("account_id",)
