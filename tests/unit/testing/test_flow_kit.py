"""The testing kit and flow control: ``deliver`` runs a call as a worker does, rate-limit windows follow the
test clock, and ``assert_rate_limited`` / ``assert_not_rate_limited`` say what a limit delayed."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_prerun

from celery_safe_time import SafeTask, rate_limit
from celery_safe_time.testing import SafeTimeTesting, assert_not_rate_limited, assert_rate_limited, deliver


@pytest.fixture(params=["memory", "sqlite"])
def st(request: pytest.FixtureRequest, safe_time_app: Celery) -> SafeTimeTesting:
    return request.getfixturevalue("safe_time" if request.param == "memory" else "safe_time_sqlite")  # type: ignore[no-any-return]


def test_rate_windows_follow_the_test_clock(st: SafeTimeTesting) -> None:
    ran: list[int] = []

    @st.app.task(name="kit.sync", shared=False)
    @rate_limit("sync:{account}", "2/h")
    def sync(account: int, n: int) -> None:
        ran.append(n)

    for n in range(5):
        deliver(sync, (1, n))
    assert ran == [0, 1]
    limited = assert_rate_limited(sync, key="sync:1", count=3)
    # Each waiting call has a place of its own: two at the hour, one at two hours (less the real
    # time the five deliveries took: the test clock runs on from where it was set).
    assert [c.wait for c in limited] == pytest.approx([3600, 3600, 7200], abs=5)
    assert st.rate_window("sync:1") == (2, 3)
    # An hour on the test clock, no real waiting: the two first places come.
    assert [r.state for r in st.run_due(advance=timedelta(minutes=59))] == []
    assert [r.state for r in st.run_due(advance=timedelta(minutes=1, seconds=1))] == ["SUCCESS", "SUCCESS"]
    assert sorted(ran) == [0, 1, 2, 3]
    st.run_due(advance=timedelta(hours=1))
    assert sorted(ran) == [0, 1, 2, 3, 4]
    assert st.rate_window("sync:1") == (1, 0)  # only the last start is within the hour
    st.advance(timedelta(hours=1))
    assert st.rate_window("sync:1") == (0, 0)
    deliver(sync, (1, 5))
    assert_rate_limited(sync, key="sync:1", count=3)  # nothing new was limited
    assert ran[-1] == 5


def test_assertions_say_what_was_limited(st: SafeTimeTesting) -> None:
    @st.app.task(name="kit.charge", shared=False)
    @rate_limit("stripe:{account}", "1/m")
    def charge(account: int) -> None: ...

    assert_not_rate_limited(charge)
    deliver(charge, (1,))
    deliver(charge, (2,))
    assert_not_rate_limited(charge)
    result = deliver(charge, (1,))
    assert result.state == "RETRY"
    with pytest.raises(
        AssertionError, match=r"expected no rate-limited call; limited: kit\.charge\[.*\] on 'stripe:1'"
    ):
        assert_not_rate_limited(charge, key="stripe:1")
    assert_not_rate_limited(charge, key="stripe:2")
    with pytest.raises(AssertionError, match=r"no rate-limited call of kit\.charge on key 'stripe:2'; limited: "):
        assert_rate_limited(charge, key="stripe:2")
    with pytest.raises(AssertionError, match=r"expected 2 rate-limited calls .* found 1"):
        assert_rate_limited(charge, count=2)
    with pytest.raises(AssertionError, match=r"waiting at least 0:02:00"):
        assert_rate_limited(charge, wait_at_least=timedelta(minutes=2))
    [call] = assert_rate_limited(charge, key="stripe:1", wait_at_least=timedelta(seconds=59))
    assert call.task_id == result.id
    with pytest.raises(ValueError, match="assert_not_rate_limited"):
        assert_rate_limited(charge, count=0)


def test_deliver_refuses_an_unknown_task(st: SafeTimeTesting) -> None:
    with pytest.raises(LookupError, match=r"kit\.nothing"):
        st.deliver("kit.nothing")


def test_a_safe_task_option_through_run_due(st: SafeTimeTesting) -> None:
    @st.app.task(base=SafeTask, name="kit.mail", shared=False, safe_time_rate_limit="1/s")
    def mail(n: int) -> int:
        return n

    # Stored calls due together: the first runs, the second is re-queued to its place a second later.
    for n in range(2):
        mail.apply_async((n,), countdown=10)
    results = st.run_due(advance=10)
    assert [r.state for r in results] == ["SUCCESS", "RETRY"]
    assert [r.state for r in st.run_due(advance=1)] == ["SUCCESS"]
    st.assert_rate_limited(mail, key="kit.mail", count=1)


def test_a_slow_run_does_not_move_the_rate_places(st: SafeTimeTesting) -> None:
    # A loaded machine, made certain: the first re-queued call to come back takes a real second
    # between the clock reaching its due time and its rate limit deciding (in its prerun). The kit's
    # answer stays the one of an idle machine: each call starts at its place, and the last one is
    # not re-queued a second time behind a start that real time made late.
    ran: list[int] = []

    @st.app.task(name="kit.slow_sync", shared=False)
    @rate_limit("slow:{account}", "2/h")
    def sync(account: int, n: int) -> None:
        ran.append(n)

    starts: list[int] = []

    def slow_start(sender: Any = None, args: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "kit.slow_sync":
            starts.append(args[1])
            if len(starts) == 6:  # the first call to come back from the store
                time.sleep(1.0)

    task_prerun.connect(slow_start, weak=False)
    try:
        for n in range(5):
            deliver(sync, (1, n))
        assert_rate_limited(sync, key="slow:1", count=3)
        assert [r.state for r in st.run_due(advance=timedelta(hours=1, seconds=1))] == ["SUCCESS", "SUCCESS"]
        assert [r.state for r in st.run_due(advance=timedelta(hours=1))] == ["SUCCESS"]
    finally:
        task_prerun.disconnect(slow_start)
    assert sorted(ran) == [0, 1, 2, 3, 4]
    assert_rate_limited(sync, key="slow:1", count=3)


def test_the_clock_stands_still_while_the_kit_runs_a_call(st: SafeTimeTesting) -> None:
    seen: list[tuple[datetime, datetime]] = []

    @st.app.task(base=SafeTask, name="kit.slow", shared=False)
    def slow() -> None:
        before = st.now()
        time.sleep(0.2)
        seen.append((before, st.now()))

    start = st.now()
    deliver(slow)
    slow.apply_async(countdown=60)
    [result] = st.run_due(advance=120)
    assert seen[0][0] == seen[0][1] >= start  # delivered at one instant
    assert seen[1][0] == seen[1][1] == result.due_at  # run at the instant it was due
    assert st.now() >= start + timedelta(seconds=120)  # and real time moves the clock again after
