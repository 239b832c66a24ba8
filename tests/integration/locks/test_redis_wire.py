"""The lean script path on a real Redis: the same answers as redis-py's Script, and every unusual
case (script unknown to Redis, a dropped connection, an error, a timeout, a fork) handed to
redis-py's path with the connection left clean."""

from __future__ import annotations

import functools
import multiprocessing
import threading
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery

from celery_safe_time.config import get_config
from celery_safe_time.locks.backends import Owner
from celery_safe_time.locks.backends.redis import SCRIPT_PACKAGE, RedisLockBackend
from celery_safe_time.locks.redis_wire import LeanScript, settle_posted
from celery_safe_time.redis_client import load_script
from tests.helpers import services

pytestmark = pytest.mark.integration

ECHO = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]), redis.call('INCR', KEYS[2])}"


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def client(redis_url: str, request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(redis_url, protocol=request.param, socket_timeout=5)
    yield made
    made.close()


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def own_client(redis_server: services.RedisServer, request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """A client of a redis-server this test owns: ``SCRIPT FLUSH`` empties the script cache of the
    whole server, so on the shared one it would fail other tests' calls running at that moment."""
    made = redis.Redis.from_url(redis_server.url, protocol=request.param, socket_timeout=5)
    yield made
    made.close()


def test_lean_calls_answer_as_redis_py_script_does(client: redis.Redis) -> None:
    acquire = load_script(SCRIPT_PACKAGE, "acquire")
    answers = {}
    for name, call in (("lean", LeanScript(client, acquire)), ("plain", client.register_script(acquire))):
        keys = [f"lock:{name}", f"fence:{name}", f"done:{name}:d"]
        client.set(f"fence:{name}", 100)
        taken = call(keys=keys, args=["tok", 30000, "task", "host", 7, "d"])
        held = call(keys=keys, args=["other", 30000, "task2", "host2", 8, "d2"])
        own = call(keys=keys, args=["tok", 30000, "task", "host", 7, "d"])
        answers[name] = (taken, held, own)
    assert answers["lean"] == answers["plain"]
    assert answers["lean"] == (
        [b"acquired", 101, b"new"],
        [b"held", b"task", b"host", b"7", b"101"],
        [b"acquired", b"101", b"own"],
    )


def test_a_script_redis_forgot_is_loaded_and_the_next_call_is_lean_again(own_client: redis.Redis) -> None:
    echo = LeanScript(own_client, ECHO)
    assert echo(["k", "n"], ["a", 1]) == [b"k", b"a", 1, 1]
    own_client.script_flush()
    assert echo(["k", "n"], ["b", 2]) == [b"k", b"b", 2, 2]
    assert echo(["k", "n"], ["c", 3]) == [b"k", b"c", 3, 3]


def test_a_killed_connection_is_replaced_and_nothing_runs_twice(client: redis.Redis) -> None:
    echo = LeanScript(client, ECHO)
    assert echo(["k", "n"], ["a", 1])[3] == 1
    kept = echo.link.connection  # the connection this thread keeps for lean calls
    kept.send_command("CLIENT", "ID")
    client.client_kill_filter(_id=kept.read_response())  # only it: the Redis is shared with other tests
    assert echo(["k", "n"], ["b", 2])[3] == 2  # the kill is seen on send or read: run once, by redis-py
    assert echo(["k", "n"], ["c", 3])[3] == 3
    assert int(client.get("n") or 0) == 3


def test_an_error_reply_raises_redis_pys_typed_error_and_the_connection_stays_usable(client: redis.Redis) -> None:
    failing = LeanScript(
        client, "if ARGV[1] == 'fail' then return redis.error_reply('BOOM went the script') end return 1"
    )
    with pytest.raises(redis.ResponseError, match="BOOM went the script"):
        failing(["k"], ["fail"])
    assert failing(["k"], ["ok"]) == 1
    client.set("not-a-number", "x")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        LeanScript(client, "return redis.call('INCR', KEYS[1])")(["not-a-number"], [])
    assert failing(["k"], ["ok"]) == 1


def test_a_reply_later_than_the_socket_timeout_never_answers_the_next_call(
    redis_server: services.RedisServer,
) -> None:
    """On a Redis of its own: the script blocks the server for 0.3 s."""
    slow = redis.Redis.from_url(redis_server.url, socket_timeout=0.2)
    try:
        script = LeanScript(
            slow,
            "local t0 = redis.call('TIME') repeat local t = redis.call('TIME') until "
            "(t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1]) return ARGV[2]",
        )
        assert script([], [0, "quick"]) == b"quick"
        with pytest.raises(redis.TimeoutError):
            script([], [300000, "late"])
        # The late replies (of the lean call and of redis-py's retry) went to closed connections.
        for n in range(5):
            assert script([], [0, f"next{n}"]) == f"next{n}".encode()
    finally:
        slow.close()


def _child_calls(script: LeanScript, out: multiprocessing.Queue[object]) -> None:
    try:
        out.put([script(["k", f"child{n}"], [f"c{n}", n])[1] for n in range(300)])
    except Exception as exc:  # reported to the parent, which fails the test
        out.put(repr(exc))


def test_a_forked_child_never_shares_its_parents_connection(client: redis.Redis) -> None:
    echo = LeanScript(client, ECHO)
    assert echo(["k", "n"], ["parent", 0])[1] == b"parent"
    context = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[object] = context.Queue()
    child = context.Process(target=_child_calls, args=(echo, out))
    child.start()
    # The parent keeps calling meanwhile: one shared socket would mix the two processes' replies.
    mine = [echo(["k", f"parent{n}"], [f"p{n}", n])[1] for n in range(300)]
    theirs = out.get(timeout=60)
    child.join(30)
    assert mine == [f"p{n}".encode() for n in range(300)]
    assert theirs == [f"c{n}".encode() for n in range(300)]


def test_each_thread_keeps_its_own_connection(client: redis.Redis) -> None:
    echo = LeanScript(client, ECHO)
    results: dict[int, list[bytes]] = {}

    def calls(t: int) -> None:
        results[t] = [echo(["k", f"t{t}"], [f"{t}-{n}", n])[1] for n in range(200)]

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {t: [f"{t}-{n}".encode() for n in range(200)] for t in range(4)}


def test_clients_the_lean_path_cannot_serve_use_redis_pys(redis_url: str) -> None:
    class Instrumented(redis.Redis):
        pass

    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    wrapped = Instrumented.from_url(redis_url)
    try:
        for other in (single, wrapped):
            echo = LeanScript(other, ECHO)
            assert not echo.lean
            assert echo(["k", "n"], ["x", 1])[1] == b"x"
    finally:
        single.close()
        wrapped.close()


def test_an_instrumented_client_keeps_every_lock_call_on_redis_pys_path(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenTelemetry's RedisInstrumentor and ddtrace wrap ``Redis.execute_command`` with wrapt (which
    sets ``__wrapped__``): their spans must see the lock's calls."""
    seen: list[object] = []
    original = redis.Redis.execute_command

    @functools.wraps(original)
    def traced(self: redis.Redis, *args: object, **options: object) -> object:
        seen.append(args[0])
        return original(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)
    client = redis.Redis.from_url(redis_url)
    try:
        echo = LeanScript(client, ECHO)
        assert not echo.lean
        assert echo(["k", "n"], ["x", 1])[1] == b"x"
        assert "EVALSHA" in seen
    finally:
        client.close()


class Answers:
    """A ``settle`` that keeps what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[object, BaseException | None]] = []

    def __call__(self, reply: object, error: BaseException | None) -> None:
        self.told.append((reply, error))


def test_a_posted_call_is_answered_before_the_next_call(client: redis.Redis) -> None:
    echo = LeanScript(client, ECHO)
    answers = Answers()
    echo.post(["k", "n"], ["a", 1], answers)
    assert answers.told == [], "a posted call does not wait for its reply"
    assert echo(["k", "n"], ["b", 2]) == [b"k", b"b", 2, 2]
    assert answers.told == [([b"k", b"a", 1, 1], None)]
    echo.post(["k", "n"], ["c", 3], answers)
    echo.link.settle()
    assert answers.told[-1] == ([b"k", b"c", 3, 3], None)
    echo.link.settle()  # nothing left to read
    assert len(answers.told) == 2


def test_a_posted_call_redis_refused_runs_again_on_redis_pys_path(own_client: redis.Redis) -> None:
    echo = LeanScript(own_client, ECHO)
    answers = Answers()
    own_client.script_flush()
    echo.post(["k", "n"], ["a", 1], answers)  # NOSCRIPT: not run
    assert echo(["k", "n"], ["b", 2])[3] == 2
    assert answers.told == [([b"k", b"a", 1, 1], None)]
    assert int(own_client.get("n") or 0) == 2


def test_settle_posted_answers_every_call_this_thread_posted_and_nothing_else(own_client: redis.Redis) -> None:
    """What the worker runs after each task: a posted call Redis refused (``NOSCRIPT``) runs again now,
    with no later call needed; another thread's posted call is left to that thread."""
    echo = LeanScript(own_client, ECHO)
    other = LeanScript(redis.Redis(connection_pool=own_client.connection_pool), ECHO)
    answers = Answers()
    own_client.script_flush()
    echo.post(["k", "n"], ["a", 1], answers)  # NOSCRIPT: not run yet
    other.post(["k", "m"], ["b", 2], answers)
    elsewhere = Answers()
    thread = threading.Thread(target=lambda: echo.post(["k", "t"], ["c", 3], elsewhere))
    thread.start()
    thread.join()
    settle_posted()
    assert sorted(answers.told) == [([b"k", b"a", 1, 1], None), ([b"k", b"b", 2, 1], None)]
    assert int(own_client.get("n") or 0) == 1
    assert elsewhere.told == []
    settle_posted()  # nothing left to read
    assert len(answers.told) == 2


def test_a_posted_call_on_a_killed_connection_runs_once(client: redis.Redis) -> None:
    echo = LeanScript(client, ECHO)
    assert echo(["k", "n"], ["a", 1])[3] == 1
    kept = echo.link.connection
    kept.send_command("CLIENT", "ID")
    client.client_kill_filter(_id=kept.read_response())
    answers = Answers()
    echo.post(["k", "n"], ["b", 2], answers)  # the kill is seen on send, or on reading the reply
    echo.link.settle()
    assert answers.told == [([b"k", b"b", 2, 2], None)]
    assert echo(["k", "n"], ["c", 3])[3] == 3


def test_a_posted_call_that_fails_is_answered_with_the_error(client: redis.Redis) -> None:
    failing = LeanScript(client, "if ARGV[1] == 'fail' then return redis.error_reply('BOOM') end return 1")
    answers = Answers()
    failing.post(["k"], ["fail"], answers)
    assert failing(["k"], ["ok"]) == 1
    [(reply, error)] = answers.told
    assert reply is None
    assert isinstance(error, redis.ResponseError)
    assert "BOOM" in str(error)


def test_an_answer_that_cannot_be_handled_does_not_fail_the_next_call(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    echo = LeanScript(client, ECHO)

    def broken(reply: object, error: BaseException | None) -> None:
        raise RuntimeError("handler bug")

    echo.post(["k", "n"], ["a", 1], broken)
    assert echo(["k", "n"], ["b", 2])[3] == 2
    assert "handling the reply of a lock script sent earlier failed" in caplog.text


def test_clients_off_the_lean_path_answer_a_post_at_once(redis_url: str) -> None:
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        echo = LeanScript(single, ECHO)
        answers = Answers()
        echo.post(["k", "n"], ["x", 1], answers)
        assert answers.told == [([b"k", b"x", 1, 1], None)]
    finally:
        single.close()


def test_the_lock_scripts_share_one_kept_connection_per_thread(
    client: redis.Redis, make_app: Callable[..., Celery]
) -> None:
    store = RedisLockBackend(client, get_config(make_app()))
    owner = Owner(task_id="t", identity="t:0:0", host="h", pid=1)
    pool = client.connection_pool

    def kept() -> int:
        """Connections checked out of the pool (a kept one is never given back)."""
        return len(pool._in_use_connections)  # type: ignore[attr-defined]

    for name in ("acquire", "release", "commit"):
        client.script_load(load_script(SCRIPT_PACKAGE, name))  # no NOSCRIPT: no call on redis-py's path
    assert kept() == 0
    assert store.acquire("wire", "tok", 30.0, owner).status == "acquired"
    answers = Answers()
    store.release_later("wire", "tok", ("t:0:0", 60.0, "t"), answers)
    assert store.acquire("wire", "tok2", 30.0, owner).status == "finished"  # the release was read first
    assert answers.told == [(True, None)]
    assert store.commit("wire", "mark", "tok2", 60.0, "t") == (True, False)
    assert kept() == 1, "acquire, release and commit keep one connection between them"


def _child_posts(script: LeanScript, out: multiprocessing.Queue[object]) -> None:
    try:
        answers = Answers()
        script.post(["k", "child"], ["c", 1], answers)
        script.link.settle()
        out.put(answers.told[0][0][1] if answers.told else repr(answers.told))  # type: ignore[index]
    except Exception as exc:  # reported to the parent, which fails the test
        out.put(repr(exc))


def test_a_forked_child_never_reads_its_parents_posted_reply(client: redis.Redis) -> None:
    echo = LeanScript(client, ECHO)
    answers = Answers()
    echo.post(["k", "parent"], ["p", 1], answers)
    context = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[object] = context.Queue()
    child = context.Process(target=_child_posts, args=(echo, out))
    child.start()
    assert out.get(timeout=60) == b"c"
    child.join(30)
    assert echo(["k", "parent"], ["q", 2])[1] == b"q"
    assert answers.told == [([b"k", b"p", 1, 1], None)]
