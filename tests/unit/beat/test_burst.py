"""The burst path's pure pieces: the collector paused while a chunk of due entries fires."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from celery_safe_time.beat.base import collector_paused


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    gc.enable()
    yield
    gc.enable()


def test_a_chunk_of_a_burst_runs_without_the_cyclic_collector_and_turns_it_back_on() -> None:
    with collector_paused(True):
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failing_chunk_turns_the_collector_back_on() -> None:
    with pytest.raises(RuntimeError), collector_paused(True):
        raise RuntimeError("publish failed")
    assert gc.isenabled()


def test_a_small_tick_leaves_the_collector_alone() -> None:
    with collector_paused(False):
        assert gc.isenabled()


def test_a_collector_turned_off_by_someone_else_stays_off() -> None:
    gc.disable()
    with collector_paused(True):
        assert not gc.isenabled()
    assert not gc.isenabled()
