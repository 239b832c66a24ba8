"""Tenants of the demo SaaS and the emails sent to them (a table, so the demo can count)."""

from __future__ import annotations

from django.db import models


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    timezone = models.CharField(max_length=64, default="UTC")
    plan = models.CharField(max_length=20, default="trial")  # trial | paid
    trial_task_id = models.CharField(max_length=255, blank=True, default="")
    trial_ends_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.name


class Email(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="emails")
    kind = models.CharField(max_length=32)  # invoice | trial_ending | reminder
    key = models.CharField(max_length=200, blank=True, default="")
    task_id = models.CharField(max_length=255, blank=True, default="")
    sent_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["kind", "key"])]

    def __str__(self) -> str:
        return f"{self.kind} to {self.tenant_id} ({self.key})"
