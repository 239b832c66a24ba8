from __future__ import annotations

from django.apps import AppConfig


class TrialsConfig(AppConfig):
    name = "demo_project.trials"
    label = "demo_trials"
