"""``@overlap_lock``, ``@idempotent``, ``@rate_limit`` and ``@concurrency_limit`` stacked above ``@app.task``
fail at decoration, naming the right order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_safe_time import concurrency_limit, idempotent, overlap_lock, rate_limit
from celery_safe_time.exceptions import DecoratorOrderError, SafeTimeError

DECORATORS: list[tuple[str, Callable[[], Callable[[Any], Any]]]] = [
    ("overlap_lock", lambda: overlap_lock("sync:{account_id}")),
    ("idempotent", lambda: idempotent("sync:{account_id}")),
    ("rate_limit", lambda: rate_limit("sync:{account_id}", "10/s")),
    ("concurrency_limit", lambda: concurrency_limit("sync:{account_id}", limit=3)),
]


@pytest.fixture(params=[False, True], ids=["lazy-proxy", "finalized-task"])
def app(request: pytest.FixtureRequest) -> Celery:
    app = Celery("order", broker="memory://", set_as_current=False)
    if request.param:
        app.finalize()  # @app.task then returns the Task itself, not a PromiseProxy
    return app


@pytest.mark.parametrize(("name", "make"), DECORATORS, ids=[n for n, _ in DECORATORS])
def test_above_app_task_is_refused_with_the_right_order(
    app: Celery, name: str, make: Callable[[], Callable[[Any], Any]]
) -> None:
    with pytest.raises(DecoratorOrderError) as info:

        @make()
        @app.task(name="order.sync", shared=False)
        def sync(account_id: int) -> None: ...

    message = str(info.value)
    assert f"@{name}" in message
    assert "BELOW @app.task" in message
    assert message.index("@app.task\n") < message.index(f"@{name}(")  # the example shows app.task first
    assert isinstance(info.value, SafeTimeError)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("make", "call"),
    [
        (lambda: rate_limit("api:{account_id}", "10/s"), "@rate_limit('api:{account_id}', '10/s')"),
        (lambda: concurrency_limit("api:{account_id}", limit=3), "@concurrency_limit('api:{account_id}', limit=3)"),
        (lambda: overlap_lock("api:{account_id}"), "@overlap_lock('api:{account_id}')"),
    ],
    ids=["rate_limit", "concurrency_limit", "overlap_lock"],
)
def test_the_suggested_order_keeps_every_argument(app: Celery, make: Callable[[], Any], call: str) -> None:
    # Issue 40, trap 8: the fix suggested for @rate_limit dropped its rate.
    with pytest.raises(DecoratorOrderError) as info:

        @make()
        @app.task(name="order.api", shared=False)
        def api(account_id: int) -> None: ...

    assert f"    @app.task\n    {call}\n" in str(info.value)


@pytest.mark.parametrize("decorator", [overlap_lock, idempotent], ids=["overlap_lock", "idempotent"])
def test_without_arguments_above_app_task_is_refused(app: Celery, decorator: Callable[..., Any]) -> None:
    def body(account_id: int) -> None: ...

    with pytest.raises(DecoratorOrderError, match=r"BELOW @app\.task"):
        decorator(app.task(name="order.bare", shared=False)(body))


@pytest.mark.parametrize(("name", "make"), DECORATORS, ids=[n for n, _ in DECORATORS])
def test_below_app_task_gives_a_task(app: Celery, name: str, make: Callable[[], Callable[[Any], Any]]) -> None:
    @app.task(name="order.sync", shared=False)
    @make()
    def sync(account_id: int) -> None: ...

    assert callable(sync.delay)
    assert sync.name == "order.sync"
