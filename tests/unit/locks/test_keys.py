"""Key templates and callables of ``overlap_lock`` / ``idempotent`` (no services)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_safe_time import idempotent, overlap_lock
from celery_safe_time.locks.keys import KeyBuilder, template_fields


def sync(account_id: int, region: str = "eu", *, full: bool = False) -> None: ...


def bound_sync(self: Any, account_id: int, region: str = "eu") -> None: ...


def test_positional_keyword_and_default_give_one_key() -> None:
    builder = KeyBuilder(sync, "sync:{account_id}:{region}")
    keys = {
        builder.render((1,), {}, bound=False),
        builder.render((), {"account_id": 1}, bound=False),
        builder.render((), {"account_id": 1, "region": "eu"}, bound=False),
        builder.render((1, "eu"), {"full": True}, bound=False),
    }
    assert keys == {"sync:1:eu"}
    assert builder.render((1, "us"), {}, bound=False) == "sync:1:us"


def test_bound_tasks_bind_without_self() -> None:
    builder = KeyBuilder(bound_sync, "sync:{account_id}:{region}")
    assert builder.render((1,), {}, bound=True) == "sync:1:eu"
    assert builder.render((), {"account_id": 1, "region": "eu"}, bound=True) == "sync:1:eu"


def test_unknown_parameter_raises_at_decoration_time() -> None:
    with pytest.raises(ValueError, match="'acount_id'"):
        overlap_lock("sync:{acount_id}")(sync)
    with pytest.raises(ValueError, match="'tenant'"):
        idempotent("invoice:{tenant}:{period}")(sync)
    with pytest.raises(ValueError, match="positions"):
        overlap_lock("sync:{0}")(sync)


def test_kwargs_functions_accept_any_name_but_fail_clearly_when_missing() -> None:
    def flexible(**kwargs: Any) -> None: ...

    builder = KeyBuilder(flexible, "x:{tenant}")
    assert builder.render((), {"tenant": 3}, bound=False) == "x:3"
    with pytest.raises(TypeError, match="no argument 'tenant'"):
        builder.render((), {}, bound=False)


def test_callable_keys_get_arguments_by_name_with_defaults() -> None:
    builder = KeyBuilder(sync, lambda account_id, region, **_: f"{region}/{account_id}")
    assert builder.render((5,), {}, bound=False) == "eu/5"
    positional = KeyBuilder(lambda a, /, b=2: None, lambda a, b: f"{a}-{b}")
    assert positional.render((1,), {}, bound=False) == "1-2"
    empty = KeyBuilder(sync, lambda **_: "")
    with pytest.raises(TypeError, match="non-empty string"):
        empty.render((1,), {}, bound=False)


def test_attribute_and_index_fields() -> None:
    assert template_fields("{order.id}:{items[0]}:{order.kind}") == ("order", "items")

    def ship(order: Any, items: list[int]) -> None: ...

    class Order:
        id = 7

    assert KeyBuilder(ship, "ship:{order.id}:{items[0]}").render((Order(), [9]), {}, bound=False) == "ship:7:9"


def test_constant_key_and_bad_spec() -> None:
    assert KeyBuilder(sync, "global-sync").render((1,), {}, bound=False) == "global-sync"
    with pytest.raises(TypeError):
        KeyBuilder(sync, 42)  # type: ignore[arg-type]


def test_wrapped_function_keeps_name_and_signature() -> None:
    import inspect

    wrapped = overlap_lock("sync:{account_id}")(sync)
    assert wrapped.__name__ == "sync"
    assert inspect.signature(wrapped) == inspect.signature(sync)
    stacked = idempotent("i:{account_id}")(wrapped)
    assert len(stacked.__safe_time_locks__) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "options",
    [{"ttl": 0}, {"on_conflict": "wait"}, {"on_backend_error": "ignore"}, {"retry_after": -1}, {"jitter": -1}],
)
def test_invalid_options_raise(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        overlap_lock("sync:{account_id}", **options)
    with pytest.raises(ValueError):
        idempotent("i:{account_id}", window=0)


def invoice(tenant: str, period: str) -> None: ...


def test_values_holding_separators_never_share_a_key() -> None:
    builder = KeyBuilder(invoice, "invoice:{tenant}:{period}")
    calls = [("acme", "x:2026-01"), ("acme:x", "2026-01"), ("acme%3Ax", "2026-01"), ("a#1", "p"), ("a%231", "p")]
    keys = [builder.render(call, {}, bound=False) for call in calls]
    assert len(set(keys)) == len(calls), keys
    assert keys[0] == "invoice:acme:x%3A2026-01"
    assert builder.render(("acme", "2026-01"), {}, bound=False) == "invoice:acme:2026-01"  # plain values as before


def test_lock_keys_stay_out_of_the_idempotency_and_slot_namespaces() -> None:
    from celery_safe_time import constants as C
    from celery_safe_time.locks.limits import slot_key

    builder = KeyBuilder(invoice, "{tenant}:{period}")
    by_callable = KeyBuilder(invoice, lambda tenant, period: tenant)
    user_keys = {
        builder.render(("idem", "x"), {}, bound=False),
        builder.render(("slot", "k#0"), {}, bound=False),
        by_callable.render(("slot:k#0", "p"), {}, bound=False),
        by_callable.render(("idem:y", "p"), {}, bound=False),
        by_callable.render(("~idem:x", "p"), {}, bound=False),
    }
    assert len(user_keys) == 5
    own = {C.IDEMPOTENT_LOCK_NAMESPACE + v for v in ("x", "y")} | {slot_key("k", 0), slot_key("k%230", 0)}
    assert slot_key("k", 0) == "slot:k#0"
    assert not user_keys & own, user_keys
