"""The soak's own bookkeeping: when the fault log says the store was unreachable."""

from __future__ import annotations

from tests.faults.test_soak import RECORD_SLACK, never_received, store_outages, unrecorded_at


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


#: Seed 699458 (postgres, amqp): the store restarted (14 to 18), was back for 1.4 s, then cut until 30.
TWO_OUTAGES_APART_1_4_S = [
    (14.0, "pg-restart-fast (pg_ctl stop -m fast, 3.8s down, start: every connection dropped)"),
    (18.0, "pg-back after -m fast"),
    (19.4, "pg-unreachable for 10.2s"),
    (30.0, "pg-back"),
]


def test_outages_closer_than_the_bridge_count_as_one() -> None:
    events = [
        *TWO_OUTAGES_APART_1_4_S,
        (40.0, "pg-stalled for 3.0s (the proxy stops forwarding on every open connection)"),
        (43.0, "pg-back after the stall"),
    ]
    assert store_outages(events, bridge=RECORD_SLACK) == [(14.0, 30.0), (40.0, 43.0)]
    assert store_outages(events) == [(14.0, 18.0), (19.4, 30.0), (40.0, 43.0)]


def test_an_end_recorded_in_the_background_is_unrecorded_until_the_store_is_back_for_good() -> None:
    """Seed 699458 (postgres, amqp): a body ended at 14.65 while the store restarted (14 to 18); the
    store was back for 1.4 s, then cut again until 30; the worker retrying the end record in the
    background every 2 s missed that window and was killed at 31: its run is re-run (acks_late)."""
    events = TWO_OUTAGES_APART_1_4_S
    bridged = store_outages(events, bridge=RECORD_SLACK)
    assert unrecorded_at(31.0, 14.65, bridged)
    assert not unrecorded_at(31.0, 14.65, store_outages(events))
    # once the store is back for longer than a retry, the end is recorded
    assert not unrecorded_at(34.0, 14.65, bridged)
    assert not unrecorded_at(10.0, 14.65, bridged)


def test_no_store_fault_no_outage() -> None:
    assert store_outages([(1.0, "redis-restart"), (2.0, "kill-9 w1 (w1.2)")]) == []


def test_a_call_whose_last_copy_no_worker_received_counts_as_lost_in_the_fetch_window() -> None:
    """Seed 836773: a rate limit re-queued a call (``retry``) and a worker was killed -9 before any
    worker logged receiving the new copy. Its first copy was received, but not that one."""
    logs = "\n".join(
        [
            "[2026-12-06 19:11:29,074: INFO/MainProcess] Task faults.entry_over_rate[a] received",
            "[2026-12-06 19:11:31,431: INFO/ForkPoolWorker-1] Task faults.entry_over_rate[a] retry: Retry in 0.19s",
            "[2026-12-06 19:11:30,000: INFO/MainProcess] Task faults.entry_over_rate[b] received",
            "[2026-12-06 19:11:30,100: INFO/ForkPoolWorker-2] Task faults.entry_over_rate[b] retry: Retry in 1s",
            "[2026-12-06 19:11:31,200: INFO/MainProcess] Task faults.entry_over_rate[b] received",
            "[2026-12-06 19:11:31,000: INFO/MainProcess] Task faults.locked[c] received",
        ]
    )
    ids = {"a", "b", "c", "d"}
    assert never_received(ids, set(), logs, kills=[100.0], now=200.0, broker="redis") == {"a", "d"}
    # only on the Redis broker, and only once a kill is a visibility timeout old
    assert never_received(ids, set(), logs, kills=[100.0], now=200.0, broker="amqp") == set()
    assert never_received(ids, set(), logs, kills=[195.0], now=200.0, broker="redis") == set()
    # a call whose message the broker still holds (queued behind a backlog, or unacked) is late, not lost
    assert never_received(ids, {"d"}, logs, kills=[100.0], now=200.0, broker="redis") == {"a"}
