"""The probe verdicts (pure: what was read goes in)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_safe_time.checks import beat_verdict, default_max_lateness, sweep_verdict

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


def test_beat_needs_a_live_lease() -> None:
    assert beat_verdict(None, {}, None).status == "fail"
    assert beat_verdict(-2, {"host": "a"}, 4).status == "fail"  # key gone: the info hash alone is stale
    check = beat_verdict(2500, {"host": "a", "pid": 7, "epoch": 4}, 4)
    assert check.status == "ok"
    assert check.value == {"host": "a", "pid": 7, "epoch": 4, "lease_left_s": 2.5}


def test_sweep_fails_only_past_the_limit() -> None:
    assert sweep_verdict(NOW, None, 5).status == "ok"
    assert sweep_verdict(NOW, NOW + timedelta(hours=1), 5).value["lateness_seconds"] == 0
    assert sweep_verdict(NOW, NOW - timedelta(seconds=5), 5).status == "ok"
    late = sweep_verdict(NOW, NOW - timedelta(seconds=5.5), 5)
    assert late.status == "fail"
    assert late.value["lateness_seconds"] == 5.5


def test_default_limit_is_three_intervals_and_at_least_a_minute() -> None:
    assert default_max_lateness(5) == 60
    assert default_max_lateness(30) == 90
