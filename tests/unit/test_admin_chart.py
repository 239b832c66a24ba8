"""The overview's per-hour buckets and SVG chart: pure functions, no Django or services."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from xml.etree import ElementTree

from celery_safe_time.contrib.django.chart import (
    CHART_HOURS,
    HourBucket,
    _nice_ceiling,
    due_chart_svg,
    hour_buckets,
    hour_start,
)

UTC = timezone.utc
NOW = datetime(2026, 3, 29, 0, 47, 12, tzinfo=UTC)
SVG = "{http://www.w3.org/2000/svg}"


def test_buckets_start_at_the_current_hour_and_fill_gaps_with_zero() -> None:
    counts = {
        datetime(2026, 3, 29, 0, tzinfo=UTC): 2,
        datetime(2026, 3, 29, 3, tzinfo=UTC): 5,
        datetime(2026, 3, 28, 23, tzinfo=UTC): 9,  # before the window
        datetime(2026, 3, 31, 0, tzinfo=UTC): 4,  # hour 48: after it
    }
    buckets = hour_buckets(counts, NOW)
    assert len(buckets) == CHART_HOURS
    assert buckets[0] == HourBucket(datetime(2026, 3, 29, 0, tzinfo=UTC), 2)
    assert [b.count for b in buckets[:4]] == [2, 0, 0, 5]
    assert sum(b.count for b in buckets) == 7
    assert buckets[-1].start == datetime(2026, 3, 30, 23, tzinfo=UTC)


def test_buckets_are_utc_hours_whatever_the_input_zone() -> None:
    berlin = timezone(timedelta(hours=2))
    buckets = hour_buckets(
        {datetime(2026, 3, 29, 4, 59, tzinfo=berlin): 1, datetime(2026, 3, 29, 2, 1, tzinfo=UTC): 1}, NOW
    )
    assert [b for b in buckets if b.count] == [HourBucket(datetime(2026, 3, 29, 2, tzinfo=UTC), 2)]
    assert hour_start(datetime(2026, 3, 29, 4, 59)) == datetime(2026, 3, 29, 4, tzinfo=UTC)  # naive = UTC


def test_axis_top_is_a_round_number() -> None:
    assert [_nice_ceiling(n) for n in (0, 1, 2, 3, 7, 10, 11, 40, 51, 999)] == [1, 1, 2, 5, 10, 10, 20, 50, 100, 1000]


def test_svg_has_one_bar_per_non_empty_hour_scaled_to_the_top() -> None:
    buckets = hour_buckets({datetime(2026, 3, 29, 1, tzinfo=UTC): 10, datetime(2026, 3, 29, 5, tzinfo=UTC): 5}, NOW)
    svg = due_chart_svg(buckets)
    root = ElementTree.fromstring(svg)  # well-formed XML: the browser draws it inline
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]
    assert [int(b.get("data-count", "0")) for b in bars] == [10, 5]
    heights = [float(b.get("height", "0")) for b in bars]
    assert abs(heights[0] - 2 * heights[1]) < 0.2
    assert float(bars[0].get("x", "0")) < float(bars[1].get("x", "0"))
    assert "2026-03-29 01:00 UTC: 10 due" in svg
    assert "15 pending delays due in the next 48 hours" in svg
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", svg)  # nothing fetched from anywhere


def test_an_empty_window_draws_axes_and_no_bars() -> None:
    root = ElementTree.fromstring(due_chart_svg(hour_buckets({}, NOW)))
    assert [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"] == []
    assert len(list(root.iter(f"{SVG}line"))) == 2
