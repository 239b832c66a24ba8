"""Inventory syncs: scheduled every few seconds, slower than their interval, one at a time per account."""

from __future__ import annotations

import time

from celery import shared_task
from django.conf import settings

from celery_safe_time import overlap_lock

from .models import SyncRun


@shared_task(bind=True)
@overlap_lock("sync:{account_id}", on_conflict="skip")
def sync_inventory(self, account_id: int) -> str:  # type: ignore[no-untyped-def]
    started = time.time()
    time.sleep(settings.SYNC_SECONDS)  # the "slow supplier API"
    SyncRun.objects.create(
        account_id=account_id,
        task_id=self.request.id or "",
        started=started,
        finished=time.time(),
        slot=str((self.request.headers or {}).get("safe_time_slot") or ""),
    )
    return f"synced {account_id}"
