"""The run history and change audit contract, on each beat backend (Redis, PostgreSQL, memory): the
records a dispatch writes with its guard, trimming, the worker's outcome, and the audit records the
definition writers append atomically with their change."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_safe_time import constants as C
from celery_safe_time.beat import history
from celery_safe_time.beat.backends import BeatBackend, SlotWrite, beat_backend
from celery_safe_time.beat.backends.memory import MemoryBeatBackend, MemoryBeatData
from celery_safe_time.beat.state import dump_state
from celery_safe_time.config import get_config
from tests.helpers.beat import coordination_settings
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0


@pytest.fixture(params=["redis", "postgres", "memory"])
def backend(request: pytest.FixtureRequest, make_app: Any) -> BeatBackend:
    return _backend(request, make_app)


@pytest.fixture(params=["redis", "postgres"])
def stored_backend(request: pytest.FixtureRequest, make_app: Any) -> BeatBackend:
    """A backend that keeps runtime entries (the in-memory one keeps none)."""
    return _backend(request, make_app)


def _backend(request: pytest.FixtureRequest, make_app: Any) -> BeatBackend:
    sizes = {"safe_time_beat_lease": 6, "safe_time_beat_history_size": 3, "safe_time_beat_audit_size": 2}
    if request.param == "memory":
        return MemoryBeatBackend(get_config(make_app(**sizes)), MemoryBeatData())
    conf = {} if request.param == "redis" else coordination_settings(request.getfixturevalue("postgres_url"))
    found = beat_backend(get_config(make_app(**sizes, **conf)))
    found.startup_checks("test")
    return found


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _dispatch(lease: Any, epoch: int, name: str, slot: float) -> int:
    record = history.published_record(slot, slot + 0.25, f"task-{slot:g}", epoch, "host-a")
    write = SlotWrite(name, dump_state(slot, slot + 1, "sig"), slot + 1, slot, history=record)
    return int(lease.write_slots(epoch, [write])[0])


def test_dispatches_record_their_runs_trimmed_to_the_size_and_the_outcome_lands_beside_them(
    backend: BeatBackend,
) -> None:
    lease = backend.make_lease()
    epoch = lease.acquire(T0)
    assert epoch is not None
    for i in range(5):
        assert _dispatch(lease, epoch, "e", T0 + i) == 1
    assert _dispatch(lease, epoch, "e", T0 + 4) == 0  # fired already: not recorded again
    # an advance (no slot) records nothing
    lease.write_slots(epoch, [SlotWrite("e", dump_state(T0 + 4, T0 + 6, "sig"), T0 + 6)])
    runs = [history.run_record("e", p, o) for p, o in backend.history("e", 10)]
    assert [r.slot.timestamp() for r in runs if r] == [T0 + 4, T0 + 3, T0 + 2]
    newest = runs[0]
    assert newest is not None
    assert (newest.task_id, newest.epoch, newest.host, newest.lateness) == ("task-1.8e+09", epoch, "host-a", 0.25)
    outcome = json.dumps({"outcome": "succeeded", "finished": T0 + 5, "runtime": 0.5})
    assert backend.history_outcome("e", T0 + 4, outcome)
    assert not backend.history_outcome("e", T0, outcome)  # trimmed away: not brought back
    done = history.run_record("e", *backend.history("e", 1)[0])
    assert done is not None
    assert (done.outcome, done.runtime) == ("succeeded", 0.5)
    assert backend.history("other", 10) == []
    # a run recorded outside a dispatch (a backfill's) is trimmed the same way
    backend.history_record("e", T0 + 10, history.published_record(T0 + 10, T0 + 11, "b", None, "h", "backfill"))
    slots = [json.loads(_text(p))["slot"] for p, _ in backend.history("e", 10)]
    assert slots == [T0 + 10, T0 + 4, T0 + 3]
    lease.release()


def test_audit_append_keeps_the_newest_records(backend: BeatBackend) -> None:
    for i in range(4):
        history.record_audit(backend, "x", "run-now", "me@h", T0 + i, n=i)
    records = [history.audit_record("x", raw) for raw in backend.audit("x", 10)]
    assert [r.detail for r in records if r] == [{"n": 3}, {"n": 2}]


def test_definition_changes_append_their_audit_with_the_old_and_new_definitions(stored_backend: BeatBackend) -> None:
    backend = stored_backend
    one = json.dumps({"task": "t", "enabled": True})
    two = json.dumps({"task": "t", "enabled": False})
    meta = history.audit_meta(backend.config, "save", "ann@h", T0)
    v1 = backend.entry_save("x", one, meta)
    assert backend.entry_save("x", one, meta) == 0  # unchanged: no change, no record
    v2 = backend.swap_definition("x", one, two, history.audit_meta(backend.config, "pause", "bob@h", T0 + 1))
    assert backend.swap_definition("x", one, two, meta) == -1  # stale: refused, no record
    records = [history.audit_record("x", raw) for raw in backend.audit("x", 10)]
    assert [(r.action, r.changed_by, r.old, r.new, r.version) for r in records if r] == [
        ("pause", "bob@h", json.loads(one), json.loads(two), v2),
        ("create", "ann@h", None, json.loads(one), v1),
    ]
    v3 = backend.entry_delete("x", history.audit_meta(backend.config, "delete", "cy@h", T0 + 2))
    latest = history.audit_record("x", backend.audit("x", 1)[0])
    assert latest is not None
    assert (latest.action, latest.old, latest.new, latest.version) == ("delete", json.loads(two), None, v3)
    assert len(backend.audit("x", 10)) == 2  # capped at the audit size
    # without an audit record (a client of the scripts from before): the change alone, as before
    assert backend.entry_save("y", one) > 0
    assert backend.audit("y", 10) == []


def test_a_deleted_entry_keeps_its_runs_and_changes_for_a_while_unless_saved_again(
    stored_backend: BeatBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = stored_backend
    lease = backend.make_lease()
    epoch = lease.acquire(T0)
    assert epoch is not None
    one = json.dumps({"task": "t"})
    for name in ("x", "y"):
        backend.entry_save(name, one, history.audit_meta(backend.config, "save", "ann@h", T0))
        assert _dispatch(lease, epoch, name, T0) == 1
    deleted = history.audit_meta(backend.config, "delete", "ann@h", backend.clock.time())
    assert backend.entry_delete("x", deleted) > 0
    assert len(backend.history("x", 10)) == 1  # kept after the deletion (for a while)
    assert [json.loads(_text(r))["action"] for r in backend.audit("x", 10)] == ["delete", "save"]
    client = getattr(backend, "client", None)
    if client is not None:
        keys = [backend.config.key(C.KEY_BEAT_AUDIT, entry="x"), backend.config.key(C.KEY_BEAT_HISTORY, entry="x")]
        assert all(0 < client.pttl(k) <= C.BEAT_DELETED_HISTORY_KEEP * 1000 for k in keys)
        backend.entry_save("x", one)  # saved again: its runs and changes are kept for good
        assert all(client.pttl(k) == -1 for k in keys)
        monkeypatch.setattr(C, "BEAT_DELETED_HISTORY_KEEP", 0.05)
        assert backend.entry_delete("x") > 0
        wait_for(lambda: backend.history("x", 10) == [] and backend.audit("x", 10) == [], 5, interval=0.05)
    else:
        monkeypatch.setattr(C, "BEAT_DELETED_HISTORY_KEEP", -60.0)  # deleted "more than a while ago"
        backend.prune_fired(lease.token)
        assert backend.history("x", 10) == []
        assert backend.audit("x", 10) == []
    assert len(backend.history("y", 10)) == 1  # an entry that is not deleted keeps everything
    assert len(backend.audit("y", 10)) == 1
    lease.release()
