"""The worker tests' window check (``tests.helpers.locks.most_in_any_window``) counts starts as the rate
rule does: a start exactly one period old has aged out, so the rule's admissions never read as an
overrun (a start landing on the microsecond one period after another read as ``limit + 1``)."""

from __future__ import annotations

from celery_safe_time.locks.rates import Rate, take
from tests.helpers.locks import most_in_any_window

T0 = 1796419478.285375  # an epoch instant as the backends report it, to the microsecond


def test_a_start_exactly_one_period_later_is_in_a_window_of_its_own() -> None:
    assert most_in_any_window([T0, T0 + 1.0], 1.0) == 1
    assert most_in_any_window([T0, T0 + 0.999999], 1.0) == 2


def test_what_the_rule_admits_never_reads_as_more_than_the_limit() -> None:
    rate = Rate(2, 1.0)
    line: list[tuple[float, str]] = []
    starts: list[tuple[float, str]] = []
    admitted: list[float] = []
    for n, now in enumerate([T0, T0 + 0.5, T0 + 0.999999, T0 + 1.0, T0 + 1.5, T0 + 2.0]):
        if take(line, starts, now, rate, f"call-{n}", reserve=False).admitted:
            admitted.append(now)
    # T0 + 0.999999 is refused (two starts in the window); T0 + 1.0 is admitted (T0 aged out).
    assert admitted == [T0, T0 + 0.5, T0 + 1.0, T0 + 1.5, T0 + 2.0]
    assert most_in_any_window(admitted, 1.0) == 2
