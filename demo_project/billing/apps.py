from __future__ import annotations

from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "demo_project.billing"
    label = "demo_billing"
