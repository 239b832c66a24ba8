"""Lock and idempotency keys: a template over a task's parameters, or a callable.

Both decorators bind the call's arguments with :func:`inspect.signature` and apply the
defaults before rendering, so ``f(1)``, ``f(a=1)`` and ``f(a=1, b=<default>)`` give the
same key. A template naming a parameter the function does not have fails at decoration
time, not on the first call in production.

Each argument value is escaped as it fills the template (``%`` -> ``%25``, ``:`` -> ``%3A``,
``#`` -> ``%23``), so values holding the separators never make two argument tuples share a key:
``invoice:{tenant}:{period}`` gives ``invoice:acme:x%3A2026-01`` for ``("acme", "x:2026-01")`` and
``invoice:acme%3Ax:2026-01`` for ``("acme:x", "2026-01")``. A key (rendered or returned by a callable)
that begins with a namespace the package keeps for itself (``idem:``, ``slot:``) or with ``~`` gets
a ``~`` in front, so an overlap lock never shares a name with an idempotent key's lock or a
concurrency slot.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping
from typing import Any

KeySpec = str | Callable[..., Any]

#: Characters escaped in argument values: the separators of key templates, and the escape itself.
_VALUE_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "#": "%23"})
#: Lock-key namespaces of the package's own locks: the in-progress lock of an idempotent key and the
#: slots of a concurrency limit (``constants.IDEMPOTENT_LOCK_NAMESPACE``, ``constants.SLOT_KEY``).
RESERVED_NAMESPACES: tuple[str, ...] = ("idem:", "slot:")
#: Put in front of a key that begins with a reserved namespace (or with itself, to stay one-to-one).
RESERVED_ESCAPE = "~"


def escape_value(text: str) -> str:
    """``text`` with ``%``, ``:`` and ``#`` percent-escaped: one argument value inside a key."""
    return text.translate(_VALUE_ESCAPES)


def outside_reserved(key: str) -> str:
    """``key``, or ``~`` + ``key`` when it begins with a reserved namespace or ``~`` (one-to-one)."""
    if key.startswith(RESERVED_ESCAPE) or key.startswith(RESERVED_NAMESPACES):
        return RESERVED_ESCAPE + key
    return key


class _EscapingFormatter(string.Formatter):
    """``str.format`` whose every replacement field is escaped once formatted."""

    def format_field(self, value: Any, format_spec: str) -> str:
        return escape_value(format(value, format_spec))


_FORMATTER = _EscapingFormatter()


class KeyBuilder:
    """Renders the key of one call of ``func`` from ``spec``.

    ``spec`` is a ``str.format`` template naming parameters of ``func`` (``"sync:{account_id}"``,
    attribute and index access allowed: ``"{order.id}"``) or a callable that receives the
    call's arguments by name, defaults applied, and returns the key.
    """

    def __init__(self, func: Callable[..., Any], spec: KeySpec) -> None:
        self.func = func
        self.spec = spec
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters.values())
        # A bind=True task receives the task instance as its first argument; the key binds the
        # remaining arguments, so the same template works for bound and plain tasks.
        self._unbound_signature = self.signature.replace(parameters=params[1:]) if params else self.signature
        self._accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        # Callables get the arguments by name (``lambda account_id, **_: ...`` works) unless the
        # function has positional-only or *args parameters, which have no usable names.
        positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)
        self._by_name = not any(p.kind in positional_kinds for p in params)
        # Parameters that bind by position with nothing to apply (no defaults, no */**): a call
        # passing exactly these positionally needs no Signature.bind (the common task call).
        plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
        self._plain_names = {
            bound: tuple(p.name for p in ps)
            for bound, ps in ((False, params), (True, params[1:]))
            if all(p.kind is plain and p.default is inspect.Parameter.empty for p in ps)
        }
        if isinstance(spec, str):
            self.fields = template_fields(spec)
            self._check_fields(params)
        elif callable(spec):
            self.fields = ()
        else:
            raise TypeError(f"a lock key must be a template string or a callable, got {type(spec).__name__}")

    def _check_fields(self, params: list[inspect.Parameter]) -> None:
        if not self.fields and isinstance(self.spec, str):
            return  # a constant key: one lock for every call of the task
        names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
        unknown = [f for f in self.fields if f not in names]
        if unknown and not self._accepts_var_kw:
            raise ValueError(
                f"key template {self.spec!r} names {', '.join(repr(u) for u in unknown)}, which "
                f"{getattr(self.func, '__qualname__', self.func)!r} has no parameter for "
                f"(parameters: {', '.join(sorted(names)) or 'none'})"
            )

    def arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, bound: bool) -> inspect.BoundArguments:
        """Bind one call's arguments, defaults applied.

        ``args`` never include the task instance; ``bound`` says the function is a ``bind=True``
        task, whose first parameter takes that instance and is left out of the binding.
        """
        signature = self._unbound_signature if bound else self.signature
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        return arguments

    def call_with(
        self, spec: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], *, bound: bool
    ) -> Any:
        """``spec`` called with one call's arguments as a key callable is (by name, defaults applied)."""
        arguments = self.arguments(args, kwargs, bound=bound)
        return spec(**by_name(arguments)) if self._by_name else spec(*arguments.args, **arguments.kwargs)

    def render(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, bound: bool) -> str:
        """The key for one call; raises ``TypeError`` when the arguments do not fit the function."""
        names = self._plain_names.get(bound) if isinstance(self.spec, str) else None
        if names is not None and not kwargs and len(args) == len(names):
            return self._format(dict(zip(names, args, strict=True)))
        arguments = self.arguments(args, kwargs, bound=bound)
        values = by_name(arguments)
        if isinstance(self.spec, str):
            return self._format(values)
        key = self.spec(**values) if self._by_name else self.spec(*arguments.args, **arguments.kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"key callable {self.spec!r} returned {key!r}; it must return a non-empty string")
        return outside_reserved(key)

    def _format(self, values: Mapping[str, Any]) -> str:
        assert isinstance(self.spec, str)
        try:
            return outside_reserved(_FORMATTER.format(self.spec, **values))
        except KeyError as exc:
            raise TypeError(f"key template {self.spec!r}: no argument {exc.args[0]!r} in this call") from None


def by_name(arguments: inspect.BoundArguments) -> dict[str, Any]:
    """Every argument by parameter name, ``**kwargs`` flattened into it."""
    values = dict(arguments.arguments)
    for p in arguments.signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            values.update(values.pop(p.name, {}))
    return values


def template_fields(template: str) -> tuple[str, ...]:
    """The parameter names a ``str.format`` template refers to (``"{a.b}:{c[0]}"`` -> ``a``, ``c``)."""
    fields: list[str] = []
    for _literal, field, _spec, _conv in string.Formatter().parse(template):
        if field is None:
            continue
        if field == "" or field.isdigit():
            raise ValueError(f"key template {template!r} must name parameters, not positions ({{{field}}})")
        root = field.split(".", 1)[0].split("[", 1)[0]
        if root not in fields:
            fields.append(root)
    return tuple(fields)
