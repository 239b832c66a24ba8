"""Idempotency keys in the delay store are kept apart per task: a caller's ``idempotency_key=``, a debounced
burst's key and a stored unique task's key each live in their own space, and a caller's key cannot begin
with any of the package's prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import SafeTask
from celery_safe_time.delays.debounce import RESERVED_KEY_PREFIXES
from celery_safe_time.testing import SafeTimeTesting, safe_time_testing


@pytest.fixture(params=["memory", "sqlite"])
def st(request: pytest.FixtureRequest) -> Iterator[SafeTimeTesting]:
    app = Celery("caller-keys-unit", broker="memory://", set_as_current=False)
    with safe_time_testing(app, store=request.param) as handle:
        yield handle


def _recorder(st: SafeTimeTesting, name: str, ran: list[Any], **options: Any) -> Any:
    @st.app.task(base=SafeTask, shared=False, name=name, **options)
    def record(label: str) -> str:
        ran.append((name, label))
        return label

    return record


def test_the_same_caller_key_on_two_tasks_stores_and_runs_both(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    refund = _recorder(st, "tests.keys.refund", ran)
    reindex = _recorder(st, "tests.keys.reindex", ran)
    first = refund.apply_async(["r1"], countdown=3600, idempotency_key="order-1")
    other = reindex.apply_async(["x1"], countdown=3600, idempotency_key="order-1")
    again = refund.apply_async(["r2"], countdown=3600, idempotency_key="order-1")
    assert other.id != first.id
    assert again.id == first.id  # same key, same task: the pending row answers
    assert [d.args for d in st.stored_delays(refund)] == [("r1",)]
    assert [d.args for d in st.stored_delays(reindex)] == [("x1",)]
    st.run_due(advance=3601)
    assert sorted(ran) == [("tests.keys.refund", "r1"), ("tests.keys.reindex", "x1")]


def test_apply_many_keeps_caller_keys_per_task(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    refund = _recorder(st, "tests.keys.refund", ran)
    reindex = _recorder(st, "tests.keys.reindex", ran)
    [first] = refund.apply_many([(("r1",), {}, {"countdown": 3600, "idempotency_key": "k"})])
    options = {"countdown": 3600, "idempotency_key": "k"}
    [other, same] = reindex.apply_many([(("x1",), {}, options), (("x2",), {}, options)])
    assert first.id != other.id == same.id
    st.run_due(advance=3601)
    assert sorted(ran) == [("tests.keys.refund", "r1"), ("tests.keys.reindex", "x1")]


@pytest.mark.parametrize("prefix", ["debounce:", "unique:", "caller:"])
def test_a_caller_key_in_a_reserved_prefix_is_refused_naming_the_option(st: SafeTimeTesting, prefix: str) -> None:
    refund = _recorder(st, "tests.keys.refund", [])
    with pytest.raises(ValueError, match=r"idempotency_key.*reserved"):
        refund.apply_async(["r1"], countdown=3600, idempotency_key=prefix + "tests.keys.reindex:k")
    with pytest.raises(ValueError, match=r"idempotency_key.*reserved"):
        refund.apply_many([(("r1",), {}, {"countdown": 3600, "idempotency_key": prefix + "x"})])
    assert st.stored_delays(refund) == []
    assert prefix in RESERVED_KEY_PREFIXES


def test_a_caller_key_cannot_take_a_stored_unique_task_s_row(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    export = _recorder(st, "tests.keys.export", ran, unique="export:{label}")
    refund = _recorder(st, "tests.keys.refund", ran)
    held = export.apply_async(["1"], countdown=3600)
    # The rendered unique key as a caller's key of another task: its own row, not the unique one.
    taken = refund.apply_async(["r1"], countdown=3600, idempotency_key="export:1")
    assert taken.id != held.id
    # And the other way round: a caller's key pending first does not stand in for a unique key.
    refund.apply_async(["r2"], countdown=3600, idempotency_key="export:2")
    second = export.apply_async(["2"], countdown=3600)
    assert [d.args for d in st.stored_delays(export)] == [("1",), ("2",)]
    assert second.id in {d.id for d in st.stored_delays(export)}
    st.run_due(advance=3601)
    assert sorted(ran) == [
        ("tests.keys.export", "1"),
        ("tests.keys.export", "2"),
        ("tests.keys.refund", "r1"),
        ("tests.keys.refund", "r2"),
    ]


def test_a_task_name_holding_a_colon_never_shares_a_burst(st: SafeTimeTesting) -> None:
    ran: list[Any] = []
    plain = _recorder(st, "tests.keys.a", ran)
    colon = _recorder(st, "tests.keys.a:site", ran)
    options = {"debounce": timedelta(seconds=30)}
    one = plain.apply_async(["p"], debounce_key="site:{label}", **options)
    # Task "tests.keys.a:site" with key "{label}" would render "tests.keys.a:site:p" as well.
    two = colon.apply_async(["p"], debounce_key="{label}", **options)
    assert one.id != two.id
    st.run_due(advance=31)
    assert sorted(ran) == [("tests.keys.a", "p"), ("tests.keys.a:site", "p")]
