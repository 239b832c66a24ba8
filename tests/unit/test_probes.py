"""The probe verdicts (pure: what was read goes in)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_safe_time.checks import beat_verdict, beats_verdict, default_max_lateness, shards_verdict, sweep_verdict

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


def _shard(shard: int, held: bool, lag: float = 0.0) -> dict[str, object]:
    return {
        "shard": shard,
        "host": "h" if held else None,
        "pid": 7 if held else None,
        "lease_left_s": 9.0 if held else None,
        "lag_s": lag,
    }


def test_sharded_beat_needs_every_shard_held() -> None:
    ok = shards_verdict([_shard(0, True), _shard(1, True, lag=2.5), _shard(2, True)])
    assert ok.status == "ok"
    assert ok.detail == "3 shards held by 1 beat(s), max lag 2.5s"
    free = shards_verdict([_shard(0, True), _shard(1, False), _shard(2, False)])
    assert free.status == "fail"
    assert "no beat holds shard(s) 1, 2 of 3" in free.detail
    assert free.value["free"] == [1, 2]  # type: ignore[index]


def _beat(shards: int, fires: bool = True, fingerprint: str = "f") -> dict[str, object]:
    return {"beat": "b", "held": 1, "shards_setting": shards, "fingerprint": fingerprint, "up_s": 1.0, "fires": fires}


def test_beat_shards_check_fails_while_the_live_beats_disagree_on_k() -> None:
    assert beats_verdict(3, [_beat(3), _beat(3)]).status == "ok"
    differ = beats_verdict(3, [_beat(3), _beat(2, fires=False)])
    assert differ.status == "fail"
    assert "safe_time_beat_shards differs: 3 here, 2, 3 on the live beats" in differ.detail
    assert beats_verdict(2, [_beat(3)]).status == "fail"  # this app's setting is not the beats'
    assert beats_verdict(3, [_beat(3, fingerprint="a"), _beat(3, fingerprint="b")]).status == "warn"
    assert beats_verdict(3, []).status == "warn"
