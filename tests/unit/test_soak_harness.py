"""The soak's own bookkeeping: when the fault log says the store was unreachable."""

from __future__ import annotations

from tests.faults.test_soak import store_outages


def test_store_outages_pair_each_cut_or_restart_with_its_return() -> None:
    events = [
        (10.0, "kill-9 w0 (w0.1)"),
        (12.0, "pg-unreachable for 3.0s"),
        (15.0, "pg-back"),
        (20.0, "pg-restart-fast (pg_ctl stop -m fast, 2.0s down, start: every connection dropped)"),
        (23.5, "pg-back after -m fast"),
        (30.0, "pg-restart (pg_ctlcluster restart: all connections dropped, server down while it restarts)"),
        (33.0, "pg-back after the restart"),
        (40.0, "pg-unreachable for 9.0s"),
    ]
    assert store_outages(list(reversed(events))) == [(12.0, 15.0), (20.0, 23.5), (30.0, 33.0), (40.0, float("inf"))]


def test_no_store_fault_no_outage() -> None:
    assert store_outages([(1.0, "redis-restart"), (2.0, "kill-9 w1 (w1.2)")]) == []
