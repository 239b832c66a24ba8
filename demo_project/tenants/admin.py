from __future__ import annotations

from django.contrib import admin

from .models import Email, Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "timezone", "plan", "trial_ends_at", "trial_task_id")


@admin.register(Email)
class EmailAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("kind", "tenant", "key", "sent_at", "task_id")
    list_filter = ("kind",)
