from __future__ import annotations

from django.db import models


class SyncRun(models.Model):
    """One run of sync_inventory; the demo checks that runs of one account never overlap."""

    account_id = models.IntegerField()
    task_id = models.CharField(max_length=255)
    started = models.FloatField()
    finished = models.FloatField()
    slot = models.CharField(max_length=64, blank=True, default="")

    def __str__(self) -> str:
        return f"account {self.account_id} {self.started:.1f}-{self.finished:.1f}"
