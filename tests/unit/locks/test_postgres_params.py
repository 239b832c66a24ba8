"""The PostgreSQL lock calls' libpq path: parameters and results in text format (no services)."""

from __future__ import annotations

import re

import pytest

from celery_safe_time.locks.backends import postgres as P


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, None),
        (True, b"t"),
        (False, b"f"),
        (0, b"0"),
        (1_700_000_000_000_000, b"1700000000000000"),
        ("lock:k\u00e9", "lock:k\u00e9".encode()),
        ([], b"{}"),
        (["ab", "c d"], b'{"ab","c d"}'),
        (['a"b', "c\\d", "e,{f}"], b'{"a\\"b","c\\\\d","e,{f}"}'),
    ],
)
def test_parameters_in_text_format(value: object, text: bytes | None) -> None:
    assert P._text_param(value, "utf-8") == text


def test_result_columns_by_kind() -> None:
    assert P._text_value(None, "i", "utf-8") is None
    assert P._text_value(b"42", "i", "utf-8") == 42
    assert P._text_value(b"t", "b", "utf-8") is True
    assert P._text_value(b"f", "b", "utf-8") is False
    assert P._text_value("h\u00f4te".encode(), "s", "utf-8") == "h\u00f4te"


@pytest.mark.parametrize("call", [P._ACQUIRE, P._RENEW, P._RELEASE, P._COMMIT, P._SESSION_RENEW,
                                  P._SESSION_RELEASE, P._SESSION_COMMIT])  # fmt: skip
def test_both_forms_have_the_same_parameters_in_order(call: P._Call) -> None:
    numbers = [int(n) for n in re.findall(rb"\$(\d+)", call.libpq)]
    assert numbers == list(range(1, len(numbers) + 1))  # each once, in order: %s keeps their order
    assert call.pyformat.count("%s") == len(numbers)
    assert "$" not in call.pyformat
