"""The beat backend contract, on each backend (``coordination`` fixture: Redis and PostgreSQL, plus the
in-memory one): lease, epoch, guard, batched writes, due reads, re-plans, status."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from celery_safe_time import constants as C
from celery_safe_time.beat.backends import BeatBackend, SlotWrite, beat_backend
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.config import get_config
from tests.helpers.beat import coordination_settings

pytestmark = pytest.mark.integration


def _states(backend: BeatBackend, names: list[str]) -> tuple[list[Any], list[float | None]]:
    """``read_states`` with text states (Redis answers bytes, which the scheduler's JSON reader takes)."""
    raws, scores = backend.read_states(names)
    return [raw.decode() if isinstance(raw, bytes) else raw for raw in raws], scores


def _all(backend: BeatBackend) -> tuple[dict[str, Any], dict[str, float]]:
    stored, scores, _ = backend.read_all()
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in stored.items()}, scores


@pytest.fixture(params=["redis", "postgres", "memory"])
def backends(request: pytest.FixtureRequest, make_app: Any) -> Callable[..., BeatBackend]:
    """Backends of one app, as several beats would hold them (one per call): Redis, PostgreSQL, memory."""
    if request.param == "memory":
        data = MemoryBeatData()
        config = get_config(make_app(safe_time_beat_lease=6))
        return lambda: MemoryBeatBackend(config, data)
    conf = {} if request.param == "redis" else coordination_settings(request.getfixturevalue("postgres_url"))
    config = get_config(make_app(safe_time_beat_lease=6, **conf))
    return lambda: beat_backend(config)


def test_the_backend_follows_the_setting(make_app: Any, coordination: dict[str, Any]) -> None:
    backend = beat_backend(get_config(make_app(**coordination)))
    assert backend.name == ("postgres" if coordination else "redis")
    backend.startup_checks("test")  # reachable; PostgreSQL creates its tables here
    assert backend.clock.offset is not None


def test_acquire_renew_release_and_the_epoch_never_resets(backends: Callable[..., BeatBackend]) -> None:
    backend = backends()
    a, b = backend.make_lease(), backends().make_lease()
    assert a.acquire(0.0) == 1
    assert b.acquire(0.0) is None
    assert a.acquire(0.0) == 1  # re-acquiring our own lease keeps the epoch
    assert a.renew()
    assert not b.renew()
    view = backend.lease_view()
    assert view.ttl_ms is not None
    assert 0 < view.ttl_ms <= 6000
    assert view.info["epoch"] == 1
    assert view.info["token"] == a.token[:8]
    assert not b.release()
    assert a.release()
    assert backend.lease_view().info == {}
    assert backend.lease_view().ttl_ms is None
    assert backend.lease_view().epoch == 1  # a release keeps the epoch counter
    assert b.acquire(0.0) == 2  # a new lease, a new epoch
    assert not a.renew()
    assert backend.holds_lease(b.token)
    assert not backend.holds_lease(a.token)


def test_guard_publishes_each_slot_once_and_only_for_the_leader(backends: Callable[..., BeatBackend]) -> None:
    backend = backends()
    a, b = backend.make_lease(), backends().make_lease()
    epoch = a.acquire(0.0)
    assert epoch is not None
    assert a.dispatch(epoch, "e", 100.0, "{}", 110.0) == 1
    assert a.dispatch(epoch, "e", 100.0, "{}", 110.0) == 0
    assert b.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1  # right epoch, wrong token
    assert a.release()
    assert a.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1
    assert b.acquire(0.0) == epoch + 1
    assert a.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1  # stale epoch
    assert b.dispatch_slot(epoch + 1, "e", 100.0) == 0  # fired slots survive leaders
    assert b.dispatch_slot(epoch + 1, "e", 200.0) == 1
    assert _states(backend, ["e"]) == (["{}"], [110.0])


def test_a_backfill_claim_marks_slots_fired_without_the_lease(backends: Callable[..., BeatBackend]) -> None:
    backend = backends()
    lease = backend.make_lease()
    epoch = lease.acquire(0.0)
    assert epoch is not None
    assert lease.dispatch(epoch, "e", 100.0, "{}", 110.0) == 1  # the leader fired 100
    assert backend.claim_slots("e", [100.0, 110.0, 120.0], "backfill:a") == [False, True, True]
    # the same call asked again (its reply lost) still answers for its own slots; another does not
    assert backend.claim_slots("e", [110.0, 120.0, 130.0], "backfill:a") == [True, True, True]
    assert backends().claim_slots("e", [110.0, 130.0, 140.0], "backfill:b") == [False, False, True]
    assert backend.claim_slots("e", [], "backfill:c") == []
    # and the leader does not publish a claimed slot
    assert lease.dispatch(epoch, "e", 140.0, "{}", 150.0) == 0
    assert lease.dispatch_slot(epoch, "e", 120.0) == 0
    assert backend.slot_fired("e", 130.0)
    assert not backend.slot_fired("other", 130.0)


def test_write_slots_in_one_batch_same_verdicts(backends: Callable[..., BeatBackend]) -> None:
    backend = backends()
    a, b = backend.make_lease(), backends().make_lease()
    epoch = a.acquire(0.0)
    assert epoch is not None
    writes = [
        SlotWrite("x", '{"last": 100}', 110.0, 100.0),
        SlotWrite("x", '{"last": 100}', 110.0, 100.0),  # the same slot again: already fired
        SlotWrite("y", '{"last": 5}', 205.0),  # advance only
        SlotWrite("z", '{"last": 7}', 17.0, 7.0),
        SlotWrite("z", '{"last": 8}', 18.0, 8.0),  # run_all: two slots of one entry, the last state stands
    ]
    assert a.write_slots(epoch, writes) == [1, 0, 1, 1, 1]
    assert b.write_slots(epoch, writes) == [-1] * len(writes)
    raws, scores = _states(backend, ["x", "y", "z", "missing"])
    assert raws == ['{"last": 100}', '{"last": 5}', '{"last": 8}', None]
    assert scores == [110.0, 205.0, 18.0, None]
    assert a.write_slots(epoch, [SlotWrite("x", "{}", 120.0, 110.0), SlotWrite("x", "{}", 130.0, 100.0)]) == [1, 0]


def test_the_due_read_gives_the_due_entries_and_the_head_within_the_window(
    backends: Callable[..., BeatBackend],
) -> None:
    """The due entries only, however many follow them soon; the head when it is due within
    ``BEAT_HEAD_WINDOW`` (Redis reads both in one range; the others may give a later head too)."""
    backend = backends()
    lease = backend.make_lease()
    epoch = lease.acquire(0.0)
    assert epoch is not None
    window = C.BEAT_HEAD_WINDOW
    nexts = {"due1": 90.0, "due2": 100.0, "soon": 100.5, "edge": 100.0 + window, "far": 100.0 + window + 10}
    assert backend.write_plan(lease.token, {name: "{}" for name in nexts}, nexts, [], [])
    read = backend.read_due(100.0, 100)
    assert read.due == [("due1", 90.0), ("due2", 100.0)]  # at "now" is due, just after is not
    assert read.head == [("due1", 90.0)]
    assert (read.due_count, read.state_count) == (5, 5)
    assert backend.read_due(100.0, 1).due == [("due1", 90.0)]  # the limit
    read = backend.read_due(99.0, 2)  # the limit taken by a due and a soon entry: only the due one
    assert read.due == [("due1", 90.0)]
    assert backend.read_due(80.0, 100).due == []
    assert backend.read_due(80.0, 100).head in ([], [("due1", 90.0)])  # beyond the window from 80
    assert backend.read_due(90.0 - window, 100).head == [("due1", 90.0)]  # at the window's edge
    assert lease.forget(epoch, ["due1", "due2", "soon", "edge"], keep_state=False)
    read = backend.read_due(100.0, 100)
    assert read.due == []
    assert read.head in ([], [("far", 100.0 + window + 10)])
    if backend.name == "redis":
        assert read.head == []  # not read: the tick sleeps its whole granularity anyway


def test_due_reads_forget_and_replan(backends: Callable[..., BeatBackend]) -> None:
    backend = backends()
    lease = backend.make_lease()
    epoch = lease.acquire(0.0)
    assert epoch is not None
    states = {"a": json.dumps({"n": 1}), "b": json.dumps({"n": 2}), "c": json.dumps({"n": 3})}
    assert backend.write_plan(lease.token, states, {"a": 10.0, "b": 20.0, "c": float("inf")}, [], [])
    read = backend.read_due(15.0, 100)
    assert read.due == [("a", 10.0)]
    assert read.head == [("a", 10.0)]
    assert (read.due_count, read.state_count) == (3, 3)
    assert backend.head(5) == [("a", 10.0), ("b", 20.0), ("c", float("inf"))]
    assert backend.read_due(1e12, 1).due == [("a", 10.0)]  # the limit; a fired one-off (inf) is never due
    assert lease.forget(epoch, ["a"], keep_state=True)
    assert _states(backend, ["a"]) == ([states["a"]], [None])
    assert lease.forget(epoch, ["b"], keep_state=False)
    assert _states(backend, ["b"]) == ([None], [None])
    backend.drop_due("c")
    assert backend.due_count() == 0
    stored, scores = _all(backend)
    assert stored == {"a": states["a"], "c": states["c"]}
    assert scores == {}
    assert backend.write_plan(lease.token, {"d": "{}"}, {"d": 5.0}, ["a"], ["c"])
    assert _all(backend) == ({"c": states["c"], "d": "{}"}, {"d": 5.0})
    other = backends().make_lease()
    assert not backend.write_plan(other.token, {"e": "{}"}, {"e": 1.0}, [], [])
    assert not other.forget(epoch, ["d"], keep_state=False)
    assert _states(backend, ["e", "d"]) == ([None, "{}"], [None, 5.0])


def test_two_apps_on_one_backend_do_not_meet(make_app: Any, coordination: dict[str, Any]) -> None:
    one = beat_backend(get_config(make_app(**coordination)))
    other_conf = {**coordination, "safe_time_key_prefix": coordination.get("safe_time_key_prefix", "") + "other:"}
    two = beat_backend(get_config(make_app(**other_conf)))
    a, b = one.make_lease(), two.make_lease()
    assert a.acquire(0.0) == 1
    assert b.acquire(0.0) == 1
    assert a.dispatch(1, "e", 100.0, "{}", 110.0) == 1
    assert b.dispatch(1, "e", 100.0, "{}", 110.0) == 1


def test_postgres_row_counts_follow_every_write_and_a_delete_by_hand(make_app: Any, postgres_url: str) -> None:
    """The tick reads the state's counts from ``safe_time_beat_counts`` (kept by triggers), not by
    counting: they must match the table after each kind of write, the leader's and anyone's."""
    import sqlalchemy as sa

    from celery_safe_time.beat.backends.postgres import PostgresBeatBackend

    backend = beat_backend(get_config(make_app(**coordination_settings(postgres_url))))
    assert isinstance(backend, PostgresBeatBackend)
    lease = backend.make_lease()
    epoch = lease.acquire(0.0)
    assert epoch is not None

    def counts() -> tuple[int, int]:
        read = backend.read_due(0.0, 10)
        with backend.autocommit() as conn:
            total, due = conn.execute(
                sa.text("SELECT count(*), count(next_fire) FROM safe_time_beat_state WHERE ns = :ns"),
                {"ns": backend.ns},
            ).one()
        assert (read.state_count, read.due_count) == (total, due)
        return int(total), int(due)

    def by_hand(sql: str) -> None:
        with backend.engine().begin() as conn:
            conn.execute(sa.text(sql), {"ns": backend.ns})

    assert counts() == (0, 0)
    assert backend.write_plan(lease.token, {"a": "{}", "b": "{}", "c": "{}"}, {"a": 1.0, "b": 2.0, "c": 3.0}, [], [])
    assert counts() == (3, 3)
    assert lease.write_slots(epoch, [SlotWrite("a", "{}", 11.0, 1.0), SlotWrite("d", "{}", 4.0)]) == [1, 1]
    assert counts() == (4, 4)  # an update of a and the insert of d, in one statement
    assert lease.forget(epoch, ["b"], keep_state=True)
    assert counts() == (4, 3)
    assert lease.forget(epoch, ["c"], keep_state=False)
    assert counts() == (3, 2)
    backend.entry_seed_state("e", "{}")
    assert counts() == (4, 2)
    assert backend.write_plan(lease.token, {"b": "{}"}, {"b": 5.0}, ["d"], ["a"])
    assert counts() == (3, 1)
    by_hand("DELETE FROM safe_time_beat_state WHERE ns = :ns AND entry = 'b'")
    assert counts() == (2, 0)
    by_hand("UPDATE safe_time_beat_state SET next_fire = 9 WHERE ns = :ns")
    assert counts() == (2, 2)


def test_postgres_a_beat_finding_the_whole_schema_runs_no_ddl_and_one_finding_a_part_makes_the_rest(
    make_app: Any, postgres_url: str
) -> None:
    """Six beats or CLI calls starting beside writers: a ``CREATE INDEX IF NOT EXISTS`` waits for its
    table's SHARE lock even when the index is there, and deadlocked with a writer of two tables. A
    complete schema is read from the catalog and left alone; a dropped index or trigger is made again."""
    import threading

    import sqlalchemy as sa

    def fresh() -> Any:
        return beat_backend(get_config(make_app(**coordination_settings(postgres_url))))

    first = fresh()
    first.ensure_tables()
    done = threading.Event()
    with first.engine().connect() as writer, writer.begin():
        # a writer mid-transaction: ROW EXCLUSIVE on the change log, which CREATE INDEX waits behind
        writer.execute(sa.text("LOCK TABLE safe_time_beat_changes IN ROW EXCLUSIVE MODE"))
        starting = threading.Thread(target=lambda: (fresh().ensure_tables(), done.set()), daemon=True)
        starting.start()
        assert done.wait(10), "a beat starting on a complete schema waited for a writer's lock"
    with first.engine().begin() as conn:
        conn.execute(sa.text("DROP INDEX safe_time_beat_changes_version"))
        for event in ("inserted", "deleted", "truncated"):  # made together, so dropped together
            conn.execute(sa.text(f"DROP TRIGGER safe_time_beat_entries_{event} ON safe_time_beat_entries"))
    fresh().ensure_tables()
    with first.autocommit() as conn:
        assert conn.execute(sa.text("SELECT to_regclass('safe_time_beat_changes_version') IS NOT NULL")).scalar_one()
        triggers = conn.execute(sa.text("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'safe_time_beat_entries_%'"))
        assert triggers.scalar_one() == 3


def test_postgres_the_due_read_trusts_a_zero_count_and_reads_the_index_without_one(
    make_app: Any, postgres_url: str
) -> None:
    """The due read skips the due index where the counts (kept by triggers, in the same snapshot) say
    nothing is due; a missing counts row (the table emptied by hand, a database restored without the
    triggers' rows) reads the index as before, so nothing due is ever hidden."""
    import sqlalchemy as sa

    backend = beat_backend(get_config(make_app(**coordination_settings(postgres_url))))
    lease = backend.make_lease()
    epoch = lease.acquire(0.0)
    assert epoch is not None
    assert backend.write_plan(lease.token, {"a": "{}", "b": "{}"}, {"a": 1.0, "b": 50.0}, [], [])
    read = backend.read_due(10.0, 10)
    assert (read.due, read.head, read.due_count) == ([("a", 1.0)], [("a", 1.0)], 2)
    assert lease.forget(epoch, ["a", "b"], keep_state=True)  # states kept, none due: due = 0
    read = backend.read_due(1e12, 10)
    assert (read.due, read.head, read.due_count, read.state_count) == ([], [], 0, 2)
    assert backend.write_plan(lease.token, {"d": "{}"}, {"d": 7.0}, [], [])
    assert backend.read_due(10.0, 10).due == [("d", 7.0)]
    with backend.engine().begin() as conn:
        conn.execute(sa.text("DELETE FROM safe_time_beat_counts WHERE ns = :ns"), {"ns": backend.ns})
    read = backend.read_due(10.0, 10)
    assert (read.due, read.head, read.due_count) == ([("d", 7.0)], [("d", 7.0)], 0)


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def test_what_a_leader_reading_only_due_entries_reads(make_app: Any, coordination: dict[str, Any]) -> None:
    """The seam of a leader with many runtime entries: whole reads in chunks, reads by name, the
    counter without the definitions, the pause expiries, and ``entry_save_many`` as single saves."""
    backend = beat_backend(get_config(make_app(**coordination)))
    backend.ensure_tables()
    assert backend.reads_due_only
    audit = json.dumps({"action": "save", "at": 1.0})
    items = [(f"e-{i}", json.dumps({"n": i})) for i in range(7)] + [("e-1", json.dumps({"n": -1}))]
    assert backend.entry_save_many(items, audit) == [1, 2, 3, 4, 5, 6, 7, 8]
    # unchanged: nothing written; a name twice compares with its earlier definition
    assert backend.entry_save_many([("e-0", items[0][1]), ("e-2", "{}"), ("e-2", "{}")], audit) == [0, 9, 0]
    assert backend.definition_count() == backend.change_count() == 7
    assert [(r["old"], r["new"]) for r in map(json.loads, backend.audit("e-1", 5))] == [
        ({"n": 1}, {"n": -1}),
        (None, {"n": 1}),
    ]
    assert [_text(d) for d in backend.definitions(["e-1", "nope", "e-2"])] == [json.dumps({"n": -1}), None, "{}"]
    assert backend.definitions([]) == []
    chunks = list(backend.scan_definitions(3))
    assert sum(len(c) for c in chunks) >= 7
    assert {k: _text(v) for c in chunks for k, v in c.items()} == {
        k: _text(v) for k, v in backend.entry_definitions().items()
    }
    lease = backend.make_lease()
    assert lease.acquire(0.0) is not None
    names = [f"s-{i}" for i in range(5)]
    assert backend.write_plan(lease.token, dict.fromkeys(names, "{}"), dict.fromkeys(names[:3], 1.0) | {
        n: 2.0 for n in names[3:]}, [], [])  # fmt: skip
    assert backend.write_plan(lease.token, {}, {}, [], names[3:])  # planned, out of the due set
    assert {n for page in backend.scan_planned(2) for n in page} == set(names)
    assert backend.due_count() == 3
    backend.mark_applied(lease.token, "9 fp")
    meta = backend.snapshot_meta()
    assert (meta.version, meta.definitions, meta.marker) == (9, {}, "9 fp")
    backend.set_pause_expiries({"e-1": 5.0, "e-2": 6.0}, [])
    backend.set_pause_expiries({"e-3": 7.0}, ["e-1"])
    assert backend.pause_expiries() == {"e-2": 6.0, "e-3": 7.0}
    backend.set_pause_expiries({"e-4": 8.0}, [], replace=True)
    assert backend.pause_expiries() == {"e-4": 8.0}


def test_postgres_definition_count_follows_saves_deletes_and_a_delete_by_hand(make_app: Any, postgres_url: str) -> None:
    """A takeover and the operator views read the definitions' count from ``safe_time_beat_entry_counts``
    (kept by triggers), not by counting: it must match the table after every kind of write."""
    import sqlalchemy as sa

    from celery_safe_time.beat.backends.postgres import PostgresBeatBackend

    backend = beat_backend(get_config(make_app(**coordination_settings(postgres_url))))
    assert isinstance(backend, PostgresBeatBackend)

    def count() -> int:
        with backend.autocommit() as conn:
            counted = conn.execute(
                sa.text("SELECT count(*) FROM safe_time_beat_entries WHERE ns = :ns"), {"ns": backend.ns}
            ).scalar_one()
        assert backend.definition_count() == backend.entry_counts(0.0).definitions == counted
        return int(counted)

    backend.ensure_tables()
    assert count() == 0
    backend.entry_save_many([(f"n-{i}", "{}") for i in range(5)] + [("n-0", "[]")])
    assert count() == 5
    backend.entry_save("n-9", "{}")
    backend.entry_save("n-9", "[]")  # an update: no new row
    assert count() == 6
    assert backend.entry_delete("n-1")
    assert count() == 5
    with backend.engine().begin() as conn:
        conn.execute(sa.text("DELETE FROM safe_time_beat_entries WHERE ns = :ns AND name = 'n-2'"), {"ns": backend.ns})
    assert count() == 4
