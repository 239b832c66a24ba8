"""The testing plugin's stores (memory, SQLite) pass the store contract with their clock moved 30 days ahead.

Every "when" of the contract (due, stale claims, heartbeats, grace, purge ages) must come from the
store's own ``now()``, which is what lets ``run_due`` move time. The contract functions are reused as
they are (the one that compares ``now()`` with the host clock is left out: here they differ on purpose).
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path

import pytest

import tests.contract.test_store_contract as contract
from celery_safe_time.testing import TestSQLiteStore, TestStore

SKIPPED = {"test_now_is_aware_utc_and_close_to_local"}
CASES = [
    name
    for name, fn in vars(contract).items()
    if name.startswith("test_") and name not in SKIPPED and list(inspect.signature(fn).parameters) == ["any_store"]
]


@pytest.mark.parametrize("name", CASES)
def test_contract_on_a_test_store_30_days_ahead(name: str) -> None:
    store = TestStore()
    store.advance(timedelta(days=30))
    getattr(contract, name)(store)


def test_the_test_clock_only_moves_forward() -> None:
    store = TestStore()
    before = store.now()
    assert store.advance_to(before - timedelta(days=1)) >= before
    with pytest.raises(ValueError, match="only moves forward"):
        store.advance(-1)


@pytest.mark.parametrize("name", CASES)
def test_contract_on_a_test_sqlite_store_30_days_ahead(name: str, tmp_path: Path) -> None:
    """The same contract on the temporary SQLite store (``store="sqlite"``): the production SQL store
    with the moved clock in every statement that reads "now"."""
    store = TestSQLiteStore(str(tmp_path / "store"))
    try:
        store.advance(timedelta(days=30))
        getattr(contract, name)(store)
    finally:
        store.close()
    assert not (tmp_path / "store").exists()  # close() deletes the file
