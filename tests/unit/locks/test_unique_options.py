"""Issue 17: unique task options are checked when the task class is created, and the key template is
bound like ``overlap_lock``'s (signature plus defaults, ``bind=True`` or not)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_safe_time import SafeTask
from celery_safe_time.locks.unique import SPEC_ATTR, UniqueSpec


@pytest.fixture
def app() -> Celery:
    return Celery("unique-options", broker="memory://", set_as_current=False)


def _spec(task: Any) -> UniqueSpec:
    spec = getattr(type(task), SPEC_ATTR)
    assert isinstance(spec, UniqueSpec)
    return spec


def test_a_template_naming_an_unknown_parameter_fails_at_decoration(app: Celery) -> None:
    with pytest.raises(ValueError, match=r"task .*export: unique='export:\{uid\}'.*names 'uid'.*parameters: user_id"):

        @app.task(base=SafeTask, unique="export:{uid}", lazy=False, shared=False)
        def export(user_id: int) -> None: ...


def test_a_lazy_task_fails_when_the_app_creates_it_before_any_call(app: Celery) -> None:
    @app.task(base=SafeTask, unique="export:{uid}", shared=False)
    def export(user_id: int) -> None: ...

    with pytest.raises(ValueError, match="names 'uid'"):
        app.finalize()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_until": "finished"}, "unique_until must be one of executing, executed, expired"),
        ({"unique_ttl": 0}, "unique_ttl must be a positive number"),
        ({"unique_ttl": "60"}, "unique_ttl must be a positive number"),
        ({"unique_on_conflict": "skip"}, "unique_on_conflict must be one of return, raise"),
    ],
)
def test_bad_options_fail_at_decoration(app: Celery, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):

        @app.task(base=SafeTask, unique="k:{a}", lazy=False, shared=False, **options)
        def task(a: int) -> None: ...


def test_keys_bind_defaults_and_skip_the_bound_task(app: Celery) -> None:
    @app.task(base=SafeTask, unique="r:{account}:{fmt}", lazy=False, shared=False)
    def plain(account: int, fmt: str = "csv") -> None: ...

    @app.task(base=SafeTask, bind=True, unique="r:{account}:{fmt}", lazy=False, shared=False)
    def bound(self: Any, account: int, fmt: str = "csv") -> None: ...

    for task in (plain, bound):
        spec = _spec(task)
        assert spec.render((1,), {}) == "r:1:csv"
        assert spec.render((), {"account": 1, "fmt": "csv"}) == "r:1:csv"
        assert spec.render((1, "pdf"), None) == "r:1:pdf"
        assert spec.until == "executed"
        assert spec.ttl == 3600.0
        assert spec.on_conflict == "return"
        with pytest.raises(TypeError):
            spec.render((), {})


def test_a_subclass_with_a_run_method_and_a_callable_key(app: Celery) -> None:
    class Export(SafeTask):
        name = "unique-options.Export"
        unique = staticmethod(lambda user_id, **_: f"export:{user_id}")  # type: ignore[assignment]
        unique_until = "executing"

        def run(self, user_id: int) -> int:
            return user_id

    spec = _spec(Export())
    assert spec.until == "executing"
    assert spec.render((3,), {}) == "export:3"


def test_a_task_without_unique_has_no_spec(app: Celery) -> None:
    @app.task(base=SafeTask, lazy=False, shared=False)
    def plain(a: int) -> None: ...

    assert getattr(type(plain), SPEC_ATTR) is None
