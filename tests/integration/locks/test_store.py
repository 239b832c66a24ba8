"""The lock backends (Redis scripts, PostgreSQL lease rows and session advisory locks, the in-memory
store) call for call, and in-process decorated calls on each coordination backend (no workers)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import idempotent, overlap_lock, signals
from celery_safe_time.config import get_config
from celery_safe_time.exceptions import CoordinationUnavailable, LockConflict, LockLost, RedisUnavailable
from celery_safe_time.locks.backends import LockBackend, Owner, get_lock_backend
from celery_safe_time.locks.backends.redis import RedisLockBackend
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration


def owner(task_id: str) -> Owner:
    return Owner(task_id=task_id, identity=f"{task_id}:0:0", host="test-host", pid=4242)


@pytest.fixture
def store(lock_backend: LockBackend) -> LockBackend:
    return lock_backend


@pytest.fixture
def redis_store(make_app: Callable[..., Celery], redis_client: redis.Redis) -> RedisLockBackend:
    return RedisLockBackend(redis_client, get_config(make_app()))


def _session(store: LockBackend) -> bool:
    """PostgreSQL session advisory locks: held while the holder's connection lives, no expiry."""
    return bool(getattr(store, "session", False))


def test_expired_holder_cannot_renew_or_release_the_next_holders_lock(store: LockBackend) -> None:
    # A lease counts from the acquire's send and is not held if answered a third of it later: long
    # enough for a first call that also connects, on a loaded machine.
    first = store.acquire("k", "token-a", 1.5, owner("a"))
    assert first.status == "acquired"
    assert first.fence is not None
    held = store.acquire("k", "token-b", 5, owner("b"))
    assert held.status == "held"
    assert held.holder is not None
    assert held.holder.task_id == "a"
    time.sleep(1.6)  # a's lease runs out while "a" is paused
    if _session(store):
        # no lease: a paused holder keeps its lock while its connection lives
        assert store.acquire("k", "token-b", 5, owner("b")).status == "held"
        assert store.renew("k", "token-a", 5)
        assert store.release("k", "token-a")

    second = store.acquire("k", "token-b", 5, owner("b"))
    assert second.status == "acquired"
    assert second.fence is not None
    assert second.fence > first.fence
    assert not store.renew("k", "token-a", 5)
    assert not store.release("k", "token-a")
    assert store.token_of("k") == "token-b"
    assert store.renew("k", "token-b", 5)
    assert store.release("k", "token-b")
    assert store.token_of("k") is None
    third = store.acquire("k", "token-c", 5, owner("c"))
    assert third.fence is not None
    assert third.fence > second.fence
    assert store.release("k", "token-c")


def test_same_delivery_is_a_duplicate_but_a_retry_is_not(store: LockBackend) -> None:
    assert store.acquire("d", "t1", 5, owner("x")).status == "acquired"
    assert store.acquire("d", "t2", 5, owner("x")).status == "duplicate"
    retry = Owner(task_id="x", identity="x:1:0", host="test-host", pid=1)
    assert store.acquire("d", "t3", 5, retry).status == "held"


def test_lock_hash_describes_its_holder(store: LockBackend) -> None:
    store.acquire("inventory-sync:7", "secret-token", 30, owner("task-7"))
    [info] = store.scan()
    assert info.key == "inventory-sync:7"
    assert info.task_id == "task-7"
    assert info.host == "test-host"
    assert info.pid == 4242
    assert info.fence is not None
    assert info.age is not None
    assert 0 <= info.age < 2
    if _session(store):
        assert info.ttl_left is None  # no expiry: held while its connection lives
    else:
        assert info.ttl_left is not None
        assert 28 < info.ttl_left <= 30
    assert "secret-token" not in repr(info.as_dict())
    assert store.scan("inventory-sync:*")[0].key == "inventory-sync:7"
    assert store.scan("other:*") == []
    released = store.force_release("inventory-sync:7")
    assert released is not None
    assert released.task_id == "task-7"
    assert store.scan() == []
    assert store.force_release("inventory-sync:7") is None


def test_idempotent_commit_records_once_and_releases(store: LockBackend) -> None:
    assert store.acquire("idem:i", "t1", 5, owner("a"), marker="i").status == "acquired"
    assert store.commit("idem:i", "i", "t1", 60, "a", ("a:0:0", 30)) == (True, True)
    assert store.acquire("idem:i", "t2", 5, owner("b"), marker="i").status == "done"
    assert store.idempotent_done("i")
    assert store.token_of("idem:i") is None
    # repeating the commit after a lost reply still says "recorded"; another run's commit does not
    assert store.commit("idem:i", "i", "t1", 60, "a", ("a:0:0", 30)) == (True, False)
    assert store.commit("idem:i", "i", "t9", 60, "z", ("z:0:0", 30)) == (False, False)


# --- issue 13: identities, lost replies, fences across a Redis reset -------------------------


def test_lost_reply_retry_with_the_same_token_gets_the_lock_back(store: LockBackend) -> None:
    """redis-py re-sends the script after a dropped connection: the lock it set is its own."""
    first = store.acquire("lr", "tok-1", 5, owner("a"))
    again = store.acquire("lr", "tok-1", 5, owner("a"))
    assert again.status == "acquired"
    assert again.took_over
    assert again.fence == first.fence


def test_earlier_attempt_tokens_take_over_an_orphaned_lock(store: LockBackend) -> None:
    """A re-queued copy carries the token its first attempt sent without a reply: it takes that
    orphaned lock over (same fence), where on main it was a conflict ("held") and skip skipped it."""
    first = store.acquire("orphan", "tok-first", 30, owner("a"))
    copy = Owner(task_id="a", identity="a:0:0", host="other-host", pid=7)
    assert store.acquire("orphan", "tok-copy", 30, copy).status == "duplicate"
    taken = store.acquire("orphan", "tok-copy", 30, copy, earlier_tokens=("tok-zzz", "tok-first"))
    assert taken.status == "acquired"
    assert taken.took_over
    assert taken.fence == first.fence
    assert store.token_of("orphan") == "tok-copy"
    # someone else's token is never ours
    assert store.acquire("orphan", "tok-b", 30, owner("b"), earlier_tokens=("tok-first",)).status == "held"


def test_finished_delivery_is_recognised_by_its_identity(store: LockBackend) -> None:
    assert store.acquire("fin", "t1", 5, owner("a")).status == "acquired"
    assert store.release("fin", "t1", ("a:0:0", 40.0, "a"))
    # a late redelivery of that message: dropped; any other delivery: runs
    assert store.acquire("fin", "t2", 5, owner("a")).status == "finished"
    assert store.acquire("fin", "t3", 5, owner("b")).status == "acquired"
    # recorded even when the lock had been lost meanwhile (the delivery did end)
    assert not store.release("fin", "t-lost", ("c:0:0", 40.0, "c"))
    assert store.acquire("fin", "t4", 5, owner("c")).status == "finished"


def test_idempotent_and_finished_markers_expire_with_their_windows(store: LockBackend) -> None:
    assert store.acquire("idem:w", "t1", 5, owner("a"), marker="w").status == "acquired"
    assert store.commit("idem:w", "w", "t1", 0.3, "a", ("a:0:0", 0.3)) == (True, True)
    assert store.acquire("idem:w", "t2", 5, owner("a"), marker="w").status == "done"
    time.sleep(0.4)  # both windows end (on the backend's clock)
    assert not store.idempotent_done("w")
    again = store.acquire("idem:w", "t3", 5, owner("a"), marker="w")
    assert again.status == "acquired"
    # a new window starts with the next success
    assert store.commit("idem:w", "w", "t3", 60, "a") == (True, True)
    assert store.idempotent_done("w")


def test_fences_stay_monotonic_across_a_redis_reset(redis_store: RedisLockBackend, redis_client: redis.Redis) -> None:
    store = redis_store
    """Issue 13 item 9: on main the counter restarted at 1 after the data was lost, below the old
    holder's 57, so a downstream "fence >= last" check let the stale holder win."""
    redis_client.set("safe_time:lock-fence:ledger", 56)  # a counter from before this version
    old = store.acquire("ledger", "t-old", 5, owner("old"))
    assert old.fence == 57
    store.release("ledger", "t-old")
    redis_client.flushdb()  # Redis restarted without persistence
    new = store.acquire("ledger", "t-new", 5, owner("new"))
    assert new.fence is not None
    assert new.fence > old.fence
    store.release("ledger", "t-new")
    newer = store.acquire("ledger", "t-newer", 5, owner("newer"))
    assert newer.fence == new.fence + 1
    # a second reset: the new seed is again above everything handed out
    redis_client.flushdb()
    after = store.acquire("ledger", "t-after", 5, owner("after"))
    assert after.fence is not None
    assert after.fence > newer.fence
    assert isinstance(after.fence, int)


# --- in-process (direct) calls of decorated tasks -------------------------------------------
# Tasks of tests that run once per backend are shared=False: a shared task is added to every app
# finalized later in the session, and three copies under one name fail those apps (DuplicateTaskName).


def test_direct_calls_share_one_key_and_read_the_fence(
    make_app: Callable[..., Celery], coordination_conf: dict[str, Any]
) -> None:
    app = make_app(safe_time_key_prefix="tenant-a:", **coordination_conf)
    other = make_app(**coordination_conf)  # the default prefix: another deployment's locks
    seen: list[tuple[str, int, bool]] = []

    @app.task(bind=True, shared=False)
    @overlap_lock("report:{account}:{fmt}", ttl=5, on_conflict="raise")
    def report(self: Any, account: int, fmt: str = "pdf") -> None:
        held = self.request.safe_time_lock
        [info] = get_lock_backend(app).scan()
        seen.append((held.key, self.request.safe_time_fence, info.redis_key == "tenant-a:lock:" + held.key))

    report(1)
    report(account=1)
    report(account=1, fmt="pdf")
    first = seen[0][1]
    assert [(key, held) for key, _, held in seen] == [("report:1:pdf", True)] * 3
    fences = [fence for _, fence, _ in seen]
    assert fences == sorted(set(fences)), "every holder gets a larger fence"
    assert fences[0] == first
    assert get_lock_backend(app).scan() == []
    assert get_lock_backend(other).scan() == []


def test_fence_counter_is_per_prefix_on_redis(make_app: Callable[..., Celery], redis_client: redis.Redis) -> None:
    app = make_app(safe_time_key_prefix="tenant-a:")

    @app.task(bind=True, shared=False)
    @overlap_lock("report:{account}", ttl=5, on_conflict="raise")
    def report(self: Any, account: int) -> int:
        return int(self.request.safe_time_fence)

    first = report(1)
    assert report(1) == first + 1
    assert redis_client.get("tenant-a:lock-fence:report:1") == str(first + 1).encode()
    assert not redis_client.exists("safe_time:lock-fence:report:1")
    assert not redis_client.exists("tenant-a:lock:report:1")


def test_direct_call_conflict_raises(make_app: Callable[..., Celery], coordination_conf: dict[str, Any]) -> None:
    app = make_app(**coordination_conf)

    @app.task(shared=False)
    @overlap_lock("busy:{n}", ttl=5)  # on_conflict="retry" cannot re-queue a direct call: it raises
    def busy(n: int) -> str:
        return "ran"

    get_lock_backend(app).acquire("busy:1", "someone-else", 5, owner("other"))
    with pytest.raises(LockConflict, match="other on test-host"):
        busy(1)
    assert busy(2) == "ran"


def test_direct_call_with_redis_down_never_runs(make_app: Callable[..., Celery], redis_server: RedisServer) -> None:
    app = make_app(safe_time_redis_url=redis_server.url)
    ran: list[int] = []

    @app.task
    @overlap_lock("down:{n}", ttl=5)
    def guarded(n: int) -> None:
        ran.append(n)

    @app.task
    @idempotent("down:{n}", ttl=5)
    def once(n: int) -> None:
        ran.append(n)

    redis_server.stop()
    with pytest.raises(RedisUnavailable):
        guarded(1)
    with pytest.raises(RedisUnavailable):
        once(1)
    assert ran == []
    redis_server.start()
    guarded(1)
    once(1)
    once(1)
    assert ran == [1, 1]


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_direct_call_with_postgres_down_never_runs(
    make_app: Callable[..., Celery], postgres_coordination_url: str, mode: str
) -> None:
    """The coordination database does not answer (nothing listens on its port): the decorated body
    never runs; the error names PostgreSQL and the setting, as a Redis outage names Redis."""
    from tests.helpers.services import free_port

    down = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere"
    app = make_app(broker_url="memory://", safe_time_coordination_url=down, safe_time_coordination_locks=mode)
    ran: list[int] = []

    @app.task(shared=False)
    @overlap_lock("pgdown:{n}", ttl=5)
    def guarded(n: int) -> None:
        ran.append(n)

    @app.task(shared=False)
    @idempotent("pgdown:{n}", ttl=5)
    def once(n: int) -> None:
        ran.append(n)

    with pytest.raises(CoordinationUnavailable, match=r"PostgreSQL .*safe_time_coordination_url") as raised:
        guarded(1)
    assert not isinstance(raised.value, RedisUnavailable)
    with pytest.raises(CoordinationUnavailable, match="PostgreSQL"):
        once(1)
    assert ran == []
    # the same app on a database that answers runs them
    app.conf.safe_time_coordination_url = postgres_coordination_url
    from celery_safe_time.config import reset_config

    reset_config(app)
    guarded(1)
    once(1)
    once(1)
    assert ran == [1, 1]


# --- issue 13 item 8: a body that returned always gets its idempotency marker ---------------


def test_idempotent_body_that_returned_after_losing_its_lock_still_records_its_marker(
    make_app: Callable[..., Celery], coordination_conf: dict[str, Any]
) -> None:
    """On main, ``check()`` raised ``LockLost`` before the marker was written, so the next call
    ran the body again. Now the marker is recorded first and the run still ends with LockLost."""
    app = make_app(**coordination_conf)
    ran: list[str] = []

    @app.task(bind=True, shared=False)
    @idempotent("invoice:{n}", ttl=0.6)
    def invoice(self: Any, n: int) -> str:
        # The lock is taken away (an operator's `locks release`, or a pause past its lease) ...
        get_lock_backend(app).force_release("idem:invoice:" + str(n))
        deadline = time.monotonic() + 5
        try:
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except LockLost:
            # ... and this body carries on to the end (as it does under gevent, where LockLost is
            # never raised inside it, or when it catches the exception around a C call).
            ran.append("told")
        ran.append("sent")
        return "sent"

    with pytest.raises(LockLost):
        invoice(1)
    assert ran == ["told", "sent"]
    assert get_lock_backend(app).idempotent_done("invoice:1")
    assert invoice(1) is None
    assert ran == ["told", "sent"], "the body must not run a second time"


@pytest.fixture
def oom(redis_server: RedisServer) -> Iterator[Callable[[bool], None]]:
    """Switch the test's own Redis into "every write fails" (maxmemory reached, noeviction): an
    error reply, which redis-py does not retry itself, unlike a refused connection."""
    client = redis.Redis.from_url(redis_server.url)

    def set_full(full: bool) -> None:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1 if full else 0)

    yield set_full
    set_full(False)
    client.close()


def test_idempotent_commit_is_retried_through_an_outage(
    make_app: Callable[..., Celery], redis_server: RedisServer, oom: Callable[[bool], None]
) -> None:
    """On main the commit gave up after three tries in ~0.6 s and reported success with no
    marker, so a later call ran the body again. Now it keeps trying (with back-off, ~30 s)."""
    app = make_app(safe_time_redis_url=redis_server.url)
    ran: list[int] = []

    @app.task
    @idempotent("bill:{n}", ttl=10)
    def bill(n: int) -> str:
        ran.append(n)
        oom(True)  # Redis refuses writes from here on ...
        threading.Timer(1.5, oom, args=(False,)).start()  # ... for 1.5 s
        return "billed"

    started = time.monotonic()
    assert bill(1) == "billed"
    assert 1.5 <= time.monotonic() - started < 10
    check = redis.Redis.from_url(redis_server.url)
    assert check.exists("safe_time:idem:bill:1")
    assert not check.exists("safe_time:lock:idem:bill:1"), "released in the same step"
    assert bill(1) is None
    assert ran == [1]


def test_idempotent_marker_that_cannot_be_written_is_loud(
    make_app: Callable[..., Celery],
    redis_server: RedisServer,
    oom: Callable[[bool], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past the retry budget the run still succeeds (failing it would invite a retry: a second
    run), but it is logged as an error and ``signals.idempotent_unrecorded`` is sent."""
    app = make_app(safe_time_redis_url=redis_server.url)
    unrecorded: list[dict[str, Any]] = []

    def on_unrecorded(sender: Any = None, **kwargs: Any) -> None:
        unrecorded.append(kwargs)

    signals.idempotent_unrecorded.connect(on_unrecorded, weak=False)

    @app.task
    @idempotent("ship:{n}", ttl=10)
    def ship(n: int) -> str:
        oom(True)
        return "shipped"

    [lock] = ship.run.__safe_time_locks__
    pauses: list[float] = []
    lock.commit_delays = (0.01, 0.02)
    lock.sleep = pauses.append  # time is injected: no real waiting
    try:
        with caplog.at_level(logging.ERROR, logger="celery_safe_time.locks.idempotency"):
            assert ship(1) == "shipped"
    finally:
        signals.idempotent_unrecorded.disconnect(on_unrecorded)
    assert pauses == [0.01, 0.02]
    assert [u["key"] for u in unrecorded] == ["ship:1"]
    assert "maxmemory" in unrecorded[0]["error"]
    assert "could NOT be recorded after 3 attempts" in caplog.text


@pytest.mark.parametrize("mode", ["lease", "session"])
def test_postgres_expired_rows_are_purged_and_status_reads_the_rows(
    make_app: Callable[..., Celery], postgres_coordination_url: str, mode: str
) -> None:
    """Expired locks, markers and unique keys are deleted by the periodic purge (a release runs it at
    most once a minute per process); the ``[locks]`` status section reads the rows."""
    import sqlalchemy as sa

    from celery_safe_time import constants as C
    from celery_safe_time.locks.admin import describe_locks

    app = make_app(safe_time_coordination_url=postgres_coordination_url, safe_time_coordination_locks=mode)
    store = get_lock_backend(app)
    # Not under a second: a lease counts from the acquire's send, and this first call also connects.
    assert store.acquire("short", "t-short", 1.5, owner("a")).status == "acquired"
    if mode == "lease":
        time.sleep(1.6)  # the lease runs out
    else:
        assert store.release("short", "t-short")
    assert store.acquire("idem:m", "t-m", 5, owner("b"), marker="m").status == "acquired"
    assert store.commit("idem:m", "m", "t-m", 0.1, "b", ("b:0:0", 0.1)) == (True, True)
    store.unique_acquire("u", "t-u", 0.1, "queued", stored=False, host="h")
    assert store.acquire("held", "t-held", 30, owner("c")).status == "acquired"
    time.sleep(0.2)

    status = describe_locks(app)
    assert [lock["key"] for lock in status["locks"]] == ["held"]
    assert status["unique_held"] == 0

    engine = sa.create_engine(postgres_coordination_url)
    tables = (C.PG_LOCK_TABLE, C.PG_LOCK_MARKER_TABLE, C.PG_UNIQUE_TABLE)

    def rows() -> dict[str, int]:
        with engine.connect() as conn:
            return {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables}

    try:
        before = rows()
        assert before[C.PG_LOCK_MARKER_TABLE] == 2
        assert before[C.PG_UNIQUE_TABLE] == 1
        store._next_purge = 0.0  # type: ignore[attr-defined]  # due now, not in a minute
        assert store.release("held", "t-held")
        assert rows() == dict.fromkeys(tables, 0)
    finally:
        engine.dispose()


def _postgres_admin(url: str) -> Any:
    import sqlalchemy as sa

    return sa.create_engine(url, isolation_level="AUTOCOMMIT")


def _cut_other_sessions(admin: Any) -> None:
    """What a server restart does to a process's pooled connections: the server closes them."""
    import sqlalchemy as sa

    with admin.connect() as conn:
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )


def test_postgres_lock_calls_reconnect_once_after_the_server_closed_their_connection(
    make_app: Callable[..., Celery], postgres_coordination_url: str
) -> None:
    """The lock calls run on pooled DBAPI connections: one the server closed fails once, is thrown away
    and the call runs again on a new one (acquire, renew and release are token-checked, so a repeat
    is safe), as the SQLAlchemy connections did."""
    store = get_lock_backend(make_app(safe_time_coordination_url=postgres_coordination_url))
    admin = _postgres_admin(postgres_coordination_url)
    try:
        assert store.acquire("warm", "t-warm", 5, owner("w")).status == "acquired"
        assert store.release("warm", "t-warm")
        _cut_other_sessions(admin)
        acquired = store.acquire("k", "t-k", 5, owner("a"))
        assert acquired.status == "acquired"
        _cut_other_sessions(admin)
        assert store.renew("k", "t-k", 5)
        _cut_other_sessions(admin)
        assert store.release("k", "t-k", ("a:0:0", 60.0, "a"))
        assert store.acquire("k", "t-again", 5, owner("b")).status == "acquired"
    finally:
        admin.dispose()


def test_postgres_fences_move_past_the_clock_once_per_server_start(
    make_app: Callable[..., Celery], postgres_coordination_url: str
) -> None:
    """An acquire commits without waiting for its WAL flush, so a crash can forget the last fences the
    sequence handed out. The first acquire after a new server start (simulated: the recorded start
    time is made older and every session is new) moves the sequence to the database clock in
    microseconds, above those; a new session of the same start does not move it again."""
    import sqlalchemy as sa

    store = get_lock_backend(make_app(safe_time_coordination_url=postgres_coordination_url))
    admin = _postgres_admin(postgres_coordination_url)

    def fence(key: str) -> int:
        acquired = store.acquire(key, f"t-{key}", 5, owner(key))
        assert acquired.status == "acquired"
        assert acquired.fence is not None
        assert store.release(key, f"t-{key}")
        return acquired.fence

    try:
        first = fence("a")
        assert fence("b") == first + 1
        with admin.connect() as conn:
            conn.execute(sa.text("UPDATE safe_time_lock_boot SET started_at = '2000-01-01T00:00:00Z'"))
            clock_us = conn.execute(sa.text("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"))
            before = int(clock_us.scalar_one())
        _cut_other_sessions(admin)
        after_start = fence("c")
        assert after_start > before > first + 1
        _cut_other_sessions(admin)  # a new session, the same server start: no second jump
        assert fence("d") == after_start + 1
    finally:
        admin.dispose()


@pytest.mark.parametrize("mode", ["lease", "session"])
@pytest.mark.parametrize("path", ["libpq", "cursor"])
def test_postgres_lock_calls_on_both_paths(
    make_app: Callable[..., Celery], postgres_coordination_url: str, mode: str, path: str
) -> None:
    """The held-lock calls go through libpq directly on psycopg 3, and through the driver's cursor
    otherwise (another driver, gevent/eventlet): the same statements, the same answers on both."""
    app = make_app(safe_time_coordination_url=postgres_coordination_url, safe_time_coordination_locks=mode)
    store: Any = get_lock_backend(app)
    store._libpq = path == "libpq"
    # Tokens are hex in practice; quotes, backslashes, commas and braces check the array parameter.
    odd = 'a"b\\c,{d} e'
    first = store.acquire("both", odd, 5, owner("a"))
    assert first.status == "acquired"
    assert first.fence is not None
    held = store.acquire("both", "t-b", 5, owner("b"))
    assert held.status == "held"
    assert held.holder is not None
    assert (held.holder.task_id, held.holder.host, held.holder.pid, held.holder.fence) == (
        "a",
        "test-host",
        4242,
        first.fence,
    )
    assert store.acquire("both", "t-a2", 5, owner("a")).status == "duplicate"
    # A lost reply: the retry names the earlier token and takes the lock over, same fence.
    again = store.acquire("both", "t-a3", 5, owner("a"), earlier_tokens=("zz", odd))
    assert (again.status, again.fence, again.took_over) == ("acquired", first.fence, True)
    assert store.renew("both", "t-a3", 5)
    assert not store.renew("both", odd, 5)
    assert store.release("both", "t-a3", ("a:0:0", 60.0, "a"))
    assert not store.release("both", "t-a3")
    assert store.acquire("both", "t-a4", 5, owner("a")).status == "finished"
    # The conflicting acquire above drew a fence it dropped: the next holder's is still larger.
    second = store.acquire("both", "t-c", 5, owner("c"), marker="m-both")
    assert second.status == "acquired"
    assert second.fence is not None
    assert second.fence > first.fence
    assert store.commit("both", "m-both", "t-c", 60.0, "c", ("c:0:0", 60.0)) == (True, True)
    assert store.acquire("both", "t-d", 5, owner("d"), marker="m-both").status == "done"


def test_postgres_a_session_lock_renewed_while_its_task_releases_it_is_released_once(
    make_app: Callable[..., Celery], postgres_coordination_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The watchdog renews on the session's connection while the task's release ends it: one
    statement at a time on that connection (libpq refuses a second: the release failed and the
    lock's row stayed until its expiry, holding back the key's re-queued runs)."""
    import threading

    app = make_app(safe_time_coordination_url=postgres_coordination_url, safe_time_coordination_locks="session")
    store: Any = get_lock_backend(app)
    for attempt in range(60):
        token = f"t-{attempt}"
        assert store.acquire("race", token, 5, owner("a")).status == "acquired"
        stop = threading.Event()
        renewed: list[bool] = []

        def renewing(token: str, stop: threading.Event, renewed: list[bool]) -> None:
            while not stop.is_set():
                renewed.append(store.renew("race", token, 5))

        renewer = threading.Thread(target=renewing, args=(token, stop, renewed), daemon=True)
        renewer.start()
        while not renewed:
            time.sleep(0.0005)
        assert store.release("race", token), f"attempt {attempt}: the release failed"
        stop.set()
        renewer.join(10)
        assert not store.renew("race", token, 5)  # a renewal after the release finds the lock gone
        assert store.token_of("race") is None
    assert "PostgreSQL" not in caplog.text, caplog.text
