"""Encode a delayed ``apply_async`` call into a stored payload and back (pure functions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kombu import serialization
from kombu.exceptions import ContentDisallowed, DecodeError, EncodeError

from .. import constants as C
from ..exceptions import SerializationError

#: Headers of one delivery of a stored row: a retry, a new call or a gate's copy is another delivery.
DELIVERY_HEADERS = frozenset({C.HEADER_STORED, C.HEADER_DELIVERY, C.HEADER_PRIOR_RUNS})
#: apply_async options that make no sense later in another process, or are stored in columns.
_DROPPED_OPTIONS = frozenset(
    {"countdown", "eta", "expires", "producer", "connection", "publisher", "add_to_parent", "result_cls", "task_type"}
)
_PICKLE_TYPES = frozenset({"pickle", "application/x-python-serialize"})


def _name(value: Any) -> Any:
    # kombu Queue / Exchange objects are not serializable; their names route the same way.
    return getattr(value, "name", value)


def clean_options(options: Mapping[str, Any], drop_headers: frozenset[str]) -> dict[str, Any]:
    """The options worth storing: no live objects, no timing (kept in columns), no internal headers."""
    cleaned: dict[str, Any] = {}
    for key, value in options.items():
        if key in _DROPPED_OPTIONS or value is None:
            continue
        if key in ("queue", "exchange"):
            value = _name(value)
        if key == "headers":
            value = {k: v for k, v in dict(value).items() if k not in drop_headers}
        cleaned[key] = value
    return cleaned


def strip_delivery_headers(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with its ``headers`` replaced by a copy without :data:`DELIVERY_HEADERS` (if any)."""
    headers = options.get("headers")
    if headers and not DELIVERY_HEADERS.isdisjoint(headers):
        options["headers"] = {k: v for k, v in headers.items() if k not in DELIVERY_HEADERS}
    return options


@dataclasses.dataclass(frozen=True)
class Encoded:
    payload: bytes
    content_type: str
    content_encoding: str


def is_pickle(serializer: str) -> bool:
    return serializer in _PICKLE_TYPES


def encode(body: dict[str, Any], serializer: str, *, allow_pickle: bool) -> Encoded:
    """Serialize with the task's serializer; raise :class:`SerializationError` at the call site."""
    if is_pickle(serializer) and not allow_pickle:
        raise SerializationError(
            "refusing to store a pickle payload (set safe_time_allow_pickle=True to allow it: "
            "anyone who can write the store could then run code on your workers)"
        )
    try:
        content_type, content_encoding, data = serialization.dumps(body, serializer)  # type: ignore[no-untyped-call]
    except (EncodeError, TypeError, ValueError) as exc:
        raise SerializationError(f"cannot encode the task's arguments with {serializer!r}: {exc}") from exc
    if isinstance(data, str):
        data = data.encode(content_encoding or "utf-8")
    return Encoded(bytes(data), content_type, content_encoding)


def encode_call(args: Any, kwargs: Any, options: Mapping[str, Any], serializer: str, *, allow_pickle: bool) -> Encoded:
    """One call's arguments and its options worth storing, encoded (:func:`encode`)."""
    body = {"args": list(args or ()), "kwargs": dict(kwargs or {}), "options": clean_options(options, DELIVERY_HEADERS)}
    return encode(body, serializer, allow_pickle=allow_pickle)


def decode(payload: bytes, content_type: str, content_encoding: str, *, allow_pickle: bool) -> dict[str, Any]:
    """Decode a stored payload; raise :class:`SerializationError` if it is corrupt or refused."""
    accept = {content_type}
    if is_pickle(content_type) and not allow_pickle:
        raise SerializationError("stored payload is pickle and safe_time_allow_pickle is False")
    try:
        body = serialization.loads(payload, content_type, content_encoding, accept=accept)  # type: ignore[no-untyped-call]
    except (ContentDisallowed, DecodeError, ValueError, TypeError, KeyError) as exc:
        raise SerializationError(f"corrupt payload ({content_type}): {exc.__class__.__name__}: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("options", {}), dict):
        raise SerializationError(f"corrupt payload ({content_type}): not a stored call")
    return body
