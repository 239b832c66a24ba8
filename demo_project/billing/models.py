from __future__ import annotations

from django.db import models


class InvoiceRun(models.Model):
    """One execution of the invoice fan-out: the demo counts runs per scheduled slot."""

    slot = models.CharField(max_length=64)
    task_id = models.CharField(max_length=255)
    hostname = models.CharField(max_length=255, blank=True, default="")
    started_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"invoices for slot {self.slot}"
