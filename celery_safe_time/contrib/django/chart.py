"""The overview page's "delays due per hour" chart: hour buckets and a server-rendered SVG.

Pure functions of what was read (no Django, no database), so they are tested without services.
The SVG is inline markup: the page needs no script, no CDN and no image request (works offline).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape

from ...clock import as_utc

#: The chart covers this many hours from the start of the current hour.
CHART_HOURS = 48

_WIDTH = 720
_HEIGHT = 180
_LEFT = 44  # room for the count labels
_BOTTOM = 24  # room for the hour labels
_TOP = 12


@dataclass(frozen=True)
class HourBucket:
    """Pending delays due in the hour starting at ``start`` (aware UTC)."""

    start: datetime
    count: int


def hour_start(moment: datetime) -> datetime:
    """The start of ``moment``'s hour, in UTC."""
    return as_utc(moment).replace(minute=0, second=0, microsecond=0)


def hour_buckets(counts: Mapping[datetime, int], now: datetime, hours: int = CHART_HOURS) -> list[HourBucket]:
    """``hours`` consecutive buckets from ``now``'s hour; ``counts`` maps an hour's start to its count.

    Hours with no entry count 0; entries outside the window are left out.
    """
    first = hour_start(now)
    by_hour: dict[datetime, int] = {}
    for start, count in counts.items():
        key = hour_start(start)
        by_hour[key] = by_hour.get(key, 0) + int(count)
    return [HourBucket(first + timedelta(hours=i), by_hour.get(first + timedelta(hours=i), 0)) for i in range(hours)]


def _nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is >= ``value`` (the y axis top)."""
    if value <= 1:
        return 1
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            if step * magnitude >= value:
                return step * magnitude
        magnitude *= 10


def due_chart_svg(buckets: list[HourBucket], *, label_every: int = 6) -> str:
    """An SVG bar chart, one bar per hour (a ``<rect class="bar">`` for every non-empty hour)."""
    top = _nice_ceiling(max((b.count for b in buckets), default=0))
    plot_w = _WIDTH - _LEFT - 4
    plot_h = _HEIGHT - _TOP - _BOTTOM
    slot_w = plot_w / max(1, len(buckets))
    total = sum(b.count for b in buckets)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="safe-time-chart" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        f'aria-label="{total} pending delays due in the next {len(buckets)} hours">',
        f"<title>{total} pending delays due in the next {len(buckets)} hours (per hour, UTC)</title>",
        f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_WIDTH - 4}" y2="{_TOP + plot_h}" stroke="#888"/>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}" stroke="#888"/>',
        f'<text x="{_LEFT - 6}" y="{_TOP + 4}" text-anchor="end" font-size="11" fill="#555">{top}</text>',
        f'<text x="{_LEFT - 6}" y="{_TOP + plot_h}" text-anchor="end" font-size="11" fill="#555">0</text>',
    ]
    for i, bucket in enumerate(buckets):
        x = _LEFT + i * slot_w
        if bucket.count:
            bar_h = max(1.0, plot_h * bucket.count / top)
            label = f"{bucket.start:%Y-%m-%d %H:00} UTC: {bucket.count} due"
            parts.append(
                f'<rect class="bar" x="{x + 1:.1f}" y="{_TOP + plot_h - bar_h:.1f}" width="{max(1.0, slot_w - 2):.1f}" '
                f'height="{bar_h:.1f}" fill="#417690" data-count="{bucket.count}"><title>{escape(label)}</title></rect>'
            )
        if i % label_every == 0:
            parts.append(
                f'<text x="{x + 1:.1f}" y="{_HEIGHT - 8}" font-size="11" fill="#555">{bucket.start:%d %H}h</text>'
            )
    parts.append("</svg>")
    return "".join(parts)
