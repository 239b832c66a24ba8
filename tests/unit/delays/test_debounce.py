"""Debounced calls through the real ``SafeTask.apply_async``, on the testing kit's store and its movable clock."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import SafeTask, signals
from celery_safe_time import constants as C
from celery_safe_time.delays.admin import list_delays
from celery_safe_time.delays.debounce import debounce_call
from celery_safe_time.exceptions import DebounceError
from celery_safe_time.testing import SafeTimeTesting, safe_time_testing

WAIT = timedelta(minutes=5)


@pytest.fixture(params=["memory", "sqlite"])
def st(request: pytest.FixtureRequest) -> Iterator[SafeTimeTesting]:
    app = Celery("debounce-unit", broker="memory://", set_as_current=False)
    # The app's own threshold (15 min): a 30 s debounce still goes through the store.
    with safe_time_testing(app, threshold=None, store=request.param) as handle:
        yield handle


def _index_task(st: SafeTimeTesting, ran: list[Any]) -> Any:
    @st.app.task(base=SafeTask, shared=False, name="tests.debounce.index")
    def index(site_id: int, edit: int = 0) -> int:
        ran.append((site_id, edit))
        return edit

    return index


def _call(task: Any, site_id: int, edit: int, **options: Any) -> Any:
    options.setdefault("debounce", timedelta(seconds=30))
    options.setdefault("debounce_key", "index:{site_id}")
    options.setdefault("debounce_max_wait", WAIT)
    return task.apply_async((site_id,), {"edit": edit}, **options)


def test_a_burst_runs_once_with_the_last_arguments_30s_after_the_last_call(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    index = _index_task(st, ran)
    first = _call(index, 1, 0)
    ids = {first.id}
    for edit in range(1, 6):
        st.advance(10)
        ids.add(_call(index, 1, edit).id)
    assert ids == {first.id}  # every call of the burst answers with the one row's id
    [row] = st.stored_delays(index)
    assert (row.args, row.kwargs) == ((1,), {"edit": 5})
    assert row.row.debounce_key == "tests.debounce.index:index:1"
    assert row.due_at == pytest.approx(st.now() + timedelta(seconds=30), abs=timedelta(seconds=1))
    assert st.run_due(advance=29) == []
    [result] = st.run_due(advance=2)
    assert (result.id, result.result) == (first.id, 5)
    assert ran == [(1, 5)]
    # The burst is over: the next call starts another one.
    assert _call(index, 1, 6).id != first.id


def test_a_burst_never_runs_later_than_the_first_call_plus_the_max_wait(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    index = _index_task(st, ran)
    start = st.now()
    first = _call(index, 2, 0, debounce_max_wait=60)
    for edit in range(1, 6):  # a call every 20 s: without the cap it would never run
        st.advance(20)
        _call(index, 2, edit, debounce_max_wait=60)
        [row] = st.stored_delays(index)
        assert row.due_at <= start + timedelta(seconds=61)
        if st.now() - start > timedelta(seconds=60):
            break
    results = st.run_due()
    assert [(r.id, r.result) for r in results] == [(first.id, 3)]
    assert ran == [(2, 3)]


def test_keys_split_bursts_and_render_from_defaults_kwargs_or_a_callable(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    index = _index_task(st, ran)
    a = _call(index, 1, 1)
    b = index.apply_async(kwargs={"site_id": 2}, debounce=30, debounce_key="index:{site_id}:{edit}")
    c = index.apply_async((1,), debounce=30, debounce_key=lambda site_id, **_: f"site-{site_id}")
    assert len({a.id, b.id, c.id}) == 3
    keys = sorted(d.row.debounce_key or "" for d in st.stored_delays(index))
    assert keys == ["tests.debounce.index:index:1", "tests.debounce.index:index:2:0", "tests.debounce.index:site-1"]
    listed = list_delays(st.app)
    assert sorted(r["debounce_key"] for r in listed) == keys


def test_cancel_of_a_debounced_row_stops_the_burst_and_the_next_call_starts_over(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    index = _index_task(st, ran)
    first = _call(index, 3, 1)
    first.revoke()
    st.assert_not_stored(index)
    again = _call(index, 3, 2)
    assert again.id != first.id
    assert [r.result for r in st.run_due(advance=31)] == [2]
    assert ran == [(3, 2)]


def test_merged_calls_are_signalled(st: SafeTimeTesting) -> None:
    index = _index_task(st, [])
    seen: list[dict[str, Any]] = []

    def on_debounced(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.delay_debounced.connect(on_debounced, weak=False)
    try:
        first = _call(index, 4, 1)
        _call(index, 4, 2)
        _call(index, 4, 3)
    finally:
        signals.delay_debounced.disconnect(on_debounced)
    assert [s["task_id"] for s in seen] == [first.id, first.id]
    assert {s["key"] for s in seen} == {"tests.debounce.index:index:4"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": 2}, "shorter than the sweep interval"),
        ({"debounce": 30, "debounce_max_wait": 10}, "debounce_max_wait=10s is shorter than debounce=30s"),
        ({"debounce": 30, "debounce_key": "index:{site}"}, "'site'"),
        ({"debounce": 30, "debounce_key": None}, "needs debounce_key="),
        ({"debounce": 30, "debounce_key": "index:{edit.missing}"}, "debounce_key="),
        ({"debounce": 0}, "must be positive"),
        ({"debounce": "30s"}, "timedelta or a number of seconds"),
        ({"debounce": 30, "idempotency_key": "k"}, "idempotency_key= cannot be given too"),
        ({"debounce": 30, "countdown": 60}, "countdown= cannot be given too"),
        ({"debounce": None, "debounce_max_wait": 60}, "needs debounce="),
    ],
)
def test_bad_options_fail_at_the_call_site(st: SafeTimeTesting, options: dict[str, Any], message: str) -> None:
    index = _index_task(st, [])
    options = {"debounce_key": "index:{site_id}", **options}
    if options.get("debounce_key") is None:
        options.pop("debounce_key")
    if options.get("debounce") is None:
        options.pop("debounce")
        options.pop("debounce_key")
    with pytest.raises(DebounceError, match=message.replace("(", r"\(").replace("[", r"\[")):
        index.apply_async((1,), **options)
    st.assert_not_stored(index)


def test_a_missing_argument_names_the_template_and_the_call(st: SafeTimeTesting) -> None:
    index = _index_task(st, [])
    with pytest.raises(DebounceError, match=r"index:\{site_id\}.*site_id"):
        index.apply_async((), {"edit": 1}, debounce=30, debounce_key="index:{site_id}")


def test_a_unique_task_cannot_be_debounced(st: SafeTimeTesting) -> None:
    @st.app.task(base=SafeTask, shared=False, unique="u:{n}")
    def unique_task(n: int) -> int:
        return n

    with pytest.raises(DebounceError, match="unique task"):
        unique_task.apply_async((1,), debounce=30, debounce_key="u:{n}")


def test_a_bound_task_binds_its_key_without_self(st: SafeTimeTesting) -> None:
    @st.app.task(base=SafeTask, shared=False, bind=True, name="tests.debounce.bound")
    def bound(self: Any, site_id: int) -> int:
        return site_id

    bound.apply_async((7,), debounce=30, debounce_key="b:{site_id}")
    [row] = st.stored_delays(bound)
    assert row.row.debounce_key == "tests.debounce.bound:b:7"


def test_eager_mode_runs_each_call_at_once() -> None:
    app = Celery("debounce-eager", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.safe_time_redis_url = "redis://127.0.0.1:1/0"  # read into the config, never reached
    ran: list[int] = []

    @app.task(base=SafeTask, shared=False)
    def index(site_id: int) -> None:
        ran.append(site_id)

    index.apply_async((1,), debounce=30, debounce_key="i:{site_id}")
    index.apply_async((1,), debounce=30, debounce_key="i:{site_id}")
    assert ran == [1, 1]


def test_debounce_call_checks_are_pure() -> None:
    def run(site_id: int) -> None: ...

    call = debounce_call(
        "t",
        staticmethod(run),
        type("Task", (), {}),
        {C.OPTION_DEBOUNCE: timedelta(seconds=30), C.OPTION_DEBOUNCE_KEY: "i:{site_id}"},
        (5,),
        {},
        sweep_interval=5.0,
    )
    assert (call.key, call.period, call.max_wait) == ("t:i:5", 30.0, None)
    assert call.stored_key == C.DEBOUNCE_KEY_PREFIX + "t:i:5"
    with pytest.raises(DebounceError, match="longer than"):
        debounce_call(
            "t",
            staticmethod(run),
            type("Task2", (), {}),
            {C.OPTION_DEBOUNCE: 30, C.OPTION_DEBOUNCE_KEY: "i:{site_id}"},
            ("x" * 300,),
            {},
            sweep_interval=5.0,
        )


def test_apply_many_merges_debounced_calls_one_by_one(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    index = _index_task(st, ran)
    options = {"debounce": 30, "debounce_key": "index:{site_id}"}
    results = index.apply_many([((1,), {"edit": e}, options) for e in range(3)] + [((2,), {}, {"countdown": 3600})])
    assert results[0].id == results[1].id == results[2].id != results[3].id
    assert sorted((d.args, d.kwargs) for d in st.stored_delays(index)) == [((1,), {"edit": 2}), ((2,), {})]


def test_a_caller_idempotency_key_cannot_reach_a_debounced_row(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    index = _index_task(st, ran)

    @st.app.task(base=SafeTask, shared=False, name="tests.debounce.refund")
    def refund(order: str) -> None:
        ran.append(order)

    stolen = C.DEBOUNCE_KEY_PREFIX + "tests.debounce.index:index:42"
    with pytest.raises(ValueError, match=r"idempotency_key.*reserved"):
        refund.apply_async(["order-1"], countdown=3600, idempotency_key=stolen)
    with pytest.raises(ValueError, match=r"idempotency_key.*reserved"):
        refund.apply_many([(("order-1",), {}, {"countdown": 3600, "idempotency_key": stolen})])
    assert st.stored_delays(refund) == []
    debounced = _call(index, 42, 1)
    [row] = st.stored_delays(index)
    assert (row.id, row.task, row.args) == (debounced.id, "tests.debounce.index", (42,))
