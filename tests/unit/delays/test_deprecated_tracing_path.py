"""The pre-0.9 import path ``celery_safe_time.tracing`` warns and still hands out the same functions."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_the_old_tracing_path_warns_and_still_exports_instrument_and_the_context_helpers() -> None:
    sys.modules.pop("celery_safe_time.tracing", None)
    with pytest.warns(DeprecationWarning, match=r"celery_safe_time\.delays"):
        old = importlib.import_module("celery_safe_time.tracing")

    from celery_safe_time.delays import tracing

    assert old.instrument is tracing.instrument
    assert old.uninstrument is tracing.uninstrument
    assert old.inject_context is tracing.inject_context
    assert old.in_stored_context is tracing.in_stored_context
    assert old.stored_context is tracing.stored_context
    assert old.ATTRIBUTES is tracing.ATTRIBUTES
