"""The testing plugin's store passes the store contract with its clock moved 30 days ahead.

Every "when" of the contract (due, stale claims, heartbeats, grace, purge ages) must come from the
store's own ``now()``, which is what lets ``run_due`` move time. The contract functions are reused as
they are (the one that compares ``now()`` with the host clock is left out: here they differ on purpose).
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest

import tests.contract.test_store_contract as contract
from celery_safe_time.testing import TestStore

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
