"""The stored delayed task as a Django model: the same table the SQLAlchemy store uses."""

from __future__ import annotations

from django.db import models

from ... import constants as C

STATUS_CHOICES = [(status, status) for status in C.DELAY_STATUSES]
OUTCOME_CHOICES = [(outcome, outcome) for outcome in C.DELAY_OUTCOMES]


class DelayedTask(models.Model):
    """One delayed task kept until it is due (``celery_safe_time.SafeTask``)."""

    id = models.CharField(primary_key=True, max_length=C.DELAY_ID_LENGTH)
    task = models.CharField(max_length=C.DELAY_TASK_LENGTH)
    payload = models.BinaryField()
    content_type = models.CharField(max_length=C.DELAY_CONTENT_TYPE_LENGTH)
    content_encoding = models.CharField(max_length=C.DELAY_ENCODING_LENGTH)
    due_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=STATUS_CHOICES, default=C.STATUS_PENDING)
    idempotency_key = models.CharField(max_length=C.DELAY_KEY_LENGTH, null=True, blank=True)
    attempts = models.IntegerField(default=0)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    claimed_at = models.DateTimeField(null=True, blank=True)
    claim_token = models.CharField(max_length=64, null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)
    # The delivery record: which run of this row started, is alive, ended and how.
    delivery_token = models.CharField(max_length=C.DELIVERY_TOKEN_LENGTH, null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=OUTCOME_CHOICES, null=True, blank=True)
    worker = models.CharField(max_length=C.DELIVERY_WORKER_LENGTH, null=True, blank=True)
    started_by = models.CharField(max_length=C.DELIVERY_TOKEN_LENGTH, null=True, blank=True)
    starts = models.IntegerField(default=0)
    suspected_at = models.DateTimeField(null=True, blank=True)
    # safe_time_store_namespace of the app that stored it; "" from a store built by hand.
    namespace = models.CharField(max_length=C.DELAY_NAMESPACE_LENGTH, default=C.SHARED_STORE_NAMESPACE, blank=True)
    # A debounced row's cap: later calls of its burst never move it past this time.
    debounce_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = C.DELAY_TABLE
        verbose_name = "delayed task"
        ordering = ("due_at", "id")
        indexes = [
            models.Index(fields=["due_at", "id"], name=C.DELAY_DUE_INDEX, condition=models.Q(status=C.STATUS_PENDING)),
            models.Index(
                fields=["claimed_at"], name=C.DELAY_CLAIMED_INDEX, condition=models.Q(status=C.STATUS_CLAIMED)
            ),
            models.Index(fields=["sent_at"], name=C.DELAY_SENT_INDEX, condition=models.Q(status=C.STATUS_SENT)),
            models.Index(
                fields=["heartbeat_at"], name=C.DELAY_STARTED_INDEX, condition=models.Q(status=C.STATUS_STARTED)
            ),
            models.Index(
                fields=["updated_at"],
                name=C.DELAY_UPDATED_INDEX,
                condition=models.Q(status__in=sorted(C.PURGEABLE_STATUSES)),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["idempotency_key"], name=C.DELAY_KEY_INDEX, condition=models.Q(status=C.STATUS_PENDING)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task}[{self.id}] {self.status} due {self.due_at:%Y-%m-%d %H:%M:%S}"
