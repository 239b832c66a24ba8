"""Flow control as ``SafeTask`` options (``safe_time_rate_limit``, ``safe_time_concurrency_limit`` and their
keys): checked when the task is defined, errors naming the task and the option, and the same behaviour as
the decorators, run as a worker runs them on the testing kit (re-queued into its store, run at their place)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import SafeTask, concurrency_limit, rate_limit
from celery_safe_time.exceptions import LockConflict, RateLimited
from celery_safe_time.locks import current_lock
from celery_safe_time.locks.backends import Owner
from celery_safe_time.testing import SafeTimeTesting, safe_time_testing


@pytest.fixture
def app() -> Celery:
    return Celery("flow-options", broker="memory://", set_as_current=False)


@pytest.fixture
def st(app: Celery) -> Iterator[SafeTimeTesting]:
    with safe_time_testing(app) as handle:
        yield handle


# --- errors at definition --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"safe_time_rate_limit": "100 per minute"},
            ValueError,
            r"task flow\.charge: safe_time_rate_limit='100 per minute': malformed rate '100 per minute'",
        ),
        ({"safe_time_rate_limit": "0/s"}, ValueError, r"task flow\.charge: safe_time_rate_limit='0/s'.*admits no call"),
        (
            {"safe_time_concurrency_limit": 0},
            ValueError,
            r"task flow\.charge: safe_time_concurrency_limit 0: a concurrency limit must be at least 1",
        ),
        ({"safe_time_concurrency_limit": 2.5}, TypeError, r"task flow\.charge: safe_time_concurrency_limit 2\.5"),
        (
            {"safe_time_rate_limit": "10/s", "safe_time_rate_key": "stripe:{account_id}"},
            ValueError,
            r"task flow\.charge: safe_time_rate_key='stripe:\{account_id\}': key template .* names 'account_id', "
            r"which .* has no parameter for \(parameters: account, amount\)",
        ),
        (
            {"safe_time_concurrency_limit": 3, "safe_time_concurrency_key": "export:{tenant_id}"},
            ValueError,
            r"task flow\.charge: safe_time_concurrency_key='export:\{tenant_id\}': key template .* names 'tenant_id'",
        ),
        (
            {"safe_time_rate_key": "stripe:{account}"},
            ValueError,
            r"task flow\.charge: safe_time_rate_key='stripe:\{account\}' needs safe_time_rate_limit=",
        ),
        (
            {"safe_time_concurrency_key": "stripe:{account}"},
            ValueError,
            r"safe_time_concurrency_key='stripe:\{account\}' needs safe_time_concurrency_limit=",
        ),
        ({"safe_time_rate_limit": "1/s", "safe_time_rate_key": 42}, TypeError, r"safe_time_rate_key must be a key"),
    ],
)
def test_bad_options_fail_at_definition_naming_the_task_and_the_option(
    app: Celery, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):

        @app.task(base=SafeTask, name="flow.charge", lazy=False, shared=False, **options)
        def charge(account: int, amount: int) -> None: ...


def test_a_lazy_task_fails_when_the_app_creates_it(app: Celery) -> None:
    @app.task(base=SafeTask, name="flow.lazy", shared=False, safe_time_rate_limit="ten a second")
    def lazy(n: int) -> None: ...

    with pytest.raises(ValueError, match=r"task flow\.lazy: safe_time_rate_limit='ten a second'"):
        app.finalize()


def test_the_decorators_fail_at_definition_too() -> None:
    with pytest.raises(ValueError, match=r"malformed rate '100 per minute'"):
        rate_limit("k", "100 per minute")
    with pytest.raises(ValueError, match=r"rate '0/s' admits no call"):
        rate_limit("k", "0/s")
    with pytest.raises(ValueError, match=r"malformed rate '-1/s'"):
        rate_limit("k", "-1/s")
    with pytest.raises(ValueError, match=r"limit 0: a concurrency limit must be at least 1"):
        concurrency_limit("k", limit=0)
    with pytest.raises(ValueError, match=r"limit -3: a concurrency limit must be at least 1"):
        concurrency_limit("k", limit=-3)
    with pytest.raises(
        ValueError, match=r"key template 'export:\{tenant_id\}' names 'tenant_id'.*export' has no parameter"
    ):

        @concurrency_limit("export:{tenant_id}", limit=1)  # limit=1 is overlap_lock: the same check
        def export(tenant: int) -> None: ...

    with pytest.raises(
        ValueError, match=r"key template 'stripe:\{account_id\}' names 'account_id'.*charge' has no parameter"
    ):

        @rate_limit("stripe:{account_id}", "10/s")
        def charge(account: int) -> None: ...


# --- behaviour -------------------------------------------------------------------------------------


def test_the_rate_option_delays_calls_over_the_limit_to_their_place(st: SafeTimeTesting) -> None:
    ran: list[tuple[int, int]] = []

    @st.app.task(
        base=SafeTask,
        name="flow.charge",
        shared=False,
        safe_time_rate_limit="2/m",
        safe_time_rate_key="stripe:{account_id}",
    )
    def charge(account_id: int, amount: int) -> int:
        ran.append((account_id, amount))
        return amount

    assert [st.deliver(charge, (1, n)).state for n in range(3)] == ["SUCCESS", "SUCCESS", "RETRY"]
    assert st.deliver(charge, (2, 9)).state == "SUCCESS"  # another key has its own window
    [limited] = st.assert_rate_limited(charge, key="stripe:1", count=1, wait_at_least=59)
    assert limited.wait is not None
    assert limited.wait <= 60.0
    st.assert_not_rate_limited(charge, key="stripe:2")
    assert st.rate_window("stripe:1") == (2, 1)
    # The re-queued call is stored, due at its place (a minute after the first call), and runs then.
    st.assert_stored(charge, args=(1, 2), due_after=timedelta(seconds=59), due_within=timedelta(seconds=61))
    assert st.run_due(advance=timedelta(seconds=30)) == []
    [late] = st.run_due(advance=timedelta(seconds=31))
    assert late.state == "SUCCESS"
    assert ran == [(1, 0), (1, 1), (2, 9), (1, 2)]
    # A direct call is never delayed: over the limit it raises.
    assert charge(1, 3) == 3
    with pytest.raises(RateLimited):
        charge(1, 4)


def test_a_rate_without_a_key_is_one_limit_for_the_whole_task(st: SafeTimeTesting) -> None:
    @st.app.task(base=SafeTask, name="flow.report", shared=False, safe_time_rate_limit="1/s")
    def report(n: int) -> int:
        return n

    assert st.deliver(report, (1,)).state == "SUCCESS"
    assert st.deliver(report, (2,)).state == "RETRY"
    st.assert_rate_limited(report, key="flow.report", count=1)
    assert [r.state for r in st.run_due(advance=1)] == ["SUCCESS"]


def test_a_dynamic_rate_and_a_bound_task(st: SafeTimeTesting) -> None:
    @st.app.task(
        base=SafeTask,
        bind=True,
        name="flow.api",
        shared=False,
        safe_time_rate_limit=lambda customer, **_: "2/m" if customer == "gold" else "1/m",
        safe_time_rate_key="api:{customer}",
    )
    def api(self: Any, customer: str) -> str:
        return f"{self.name}:{customer}"

    assert [st.deliver(api, ("gold",)).state for _ in range(3)] == ["SUCCESS", "SUCCESS", "RETRY"]
    assert [st.deliver(api, ("basic",)).state for _ in range(2)] == ["SUCCESS", "RETRY"]
    st.assert_rate_limited(api, key="api:gold", count=1)
    st.assert_rate_limited(api, key="api:basic", count=1)


def test_the_concurrency_option_takes_a_slot_per_call(st: SafeTimeTesting) -> None:
    seen: list[str] = []

    @st.app.task(
        base=SafeTask,
        name="flow.export",
        shared=False,
        safe_time_concurrency_limit=2,
        safe_time_concurrency_key="export:{tenant_id}",
    )
    def export(tenant_id: int) -> str:
        lock = current_lock()
        assert lock is not None
        seen.append(lock.key)
        st.assert_lock_held(lock.key)
        return lock.key

    assert export.delay  # still a task
    assert st.deliver(export, (7,)).result in {"slot:export:7#0", "slot:export:7#1"}
    st.assert_lock_free("slot:export:7#0")
    st.assert_lock_free("slot:export:7#1")


def test_both_options_check_the_rate_first(st: SafeTimeTesting) -> None:
    @st.app.task(
        base=SafeTask,
        name="flow.both",
        shared=False,
        safe_time_rate_limit="1/m",
        safe_time_rate_key="r:{n}",
        safe_time_concurrency_limit=1,
        safe_time_concurrency_key="c:{n}",
    )
    def both(n: int) -> int:
        return n

    assert st.deliver(both, (1,)).state == "SUCCESS"
    # A second call waits for its rate and never asks for the slot.
    assert st.deliver(both, (1,)).state == "RETRY"
    st.assert_rate_limited(both, key="r:1", count=1)
    assert [c for c in st.limited if c.kind == "lock"] == []
    st.assert_lock_free("c:1")


def test_a_subclass_wraps_the_original_body_once(app: Celery, st: SafeTimeTesting) -> None:
    @app.task(base=SafeTask, name="flow.base", shared=False, safe_time_rate_limit="1/m", lazy=False)
    def base(n: int) -> int:
        return n

    class Unlimited(type(base)):  # type: ignore[misc]
        safe_time_rate_limit = None

    class Tighter(type(base)):  # type: ignore[misc]
        name = "flow.tighter"
        safe_time_rate_limit = "2/m"

    plain = Unlimited()
    assert [plain(n) for n in range(3)] == [0, 1, 2]  # no limit left on its body
    tighter = Tighter()
    assert [tighter(n) for n in range(2)] == [0, 1]
    with pytest.raises(RateLimited, match=r"'flow\.tighter'"):
        tighter(2)
    with pytest.raises(RateLimited, match=r"'flow\.base'"):
        [base(n) for n in range(2)]


def test_a_plain_concurrency_option_conflicts_like_overlap_lock(st: SafeTimeTesting) -> None:
    @st.app.task(base=SafeTask, name="flow.single", shared=False, safe_time_concurrency_limit=1)
    def single() -> None: ...

    st.locks.acquire("flow.single", "other", 60, Owner("t", "t:0", "h", 1))
    with pytest.raises(LockConflict):
        single()
    assert st.deliver(single).state == "RETRY"
    assert [(c.key, c.action) for c in st.limited if c.kind == "lock"] == [("flow.single", "retry")] * 2
