"""Bad input, one test per row: each gets a clear error naming the thing at fault, and nothing
already stored is lost. Plus: no password from a URL in any log or CLI output, and SQL is
parameterized throughout.

| row | what | expected |
|---|---|---|
| settings via install(app) | each malformed ``safe_time_*`` value | ``ImproperlyConfigured`` naming the key |
| settings via ``celery worker`` | ``install(app)`` at import | exit != 0, output names the key |
| settings via ``celery beat`` | SafeScheduler startup | exit != 0, output names the key |
| crontab fields / zones | ``crontab(minute="61")``, ``tz="Mars/Olympus"`` | ``ScheduleError`` naming field / zone |
| unserializable args | ``object()`` in a long countdown | ``SerializationError`` at the call, nothing stored |
| huge payload | 1 MB argument | stored, published and run intact (no size limit of our own) |
| unknown task in a row | a row naming an unregistered task | row ``failed`` naming the task; others sent |
| corrupt rows | garbage payload, pickle without opt-in, wrong shape | row ``failed``; others sent |
| warning as error | ``-W error``, two callables under one name, at publish | row back to pending; next sweep sends it |
| lock key template | ``{acount}`` for parameter ``account`` | ``ValueError`` at decoration naming both |
| wrong Redis password | locks, beat, ``safe-time check`` | clear auth error; password never printed |
| missing database | store URL to a database that does not exist | ``StoreError`` / ``check`` FAIL naming it |
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_safe_time import SafeTask, crontab, get_config, idempotent, install, overlap_lock
from celery_safe_time import constants as C
from celery_safe_time.delays.backends import get_store, reset_store
from celery_safe_time.delays.backends.sql import SQLAlchemyStore
from celery_safe_time.delays.sweep import sweep
from celery_safe_time.exceptions import (
    ImproperlyConfigured,
    RedisUnavailable,
    ScheduleError,
    SerializationError,
    StoreError,
)
from tests.helpers.delays import fresh_sql_store, new_delay, utcnow
from tests.helpers.processes import ProcessManager
from tests.helpers.services import RedisServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAULTS_APP = "tests.apps.faults_app"
PASSWORD = "S3cr3t-pw-zq81"
WRONG = "Wr0ng-pw-xk27"


# --- helpers ----------------------------------------------------------------------------


def safe_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    app = make_app("bad-input", **conf)
    install(app)

    @app.task(base=SafeTask, name="bad.record", shared=False)
    def record(*args: Any, **kwargs: Any) -> int:
        return len(args)

    return app


@pytest.fixture
def stored(make_app: Callable[..., Celery]) -> tuple[Celery, str]:
    """An app with one pending row already stored (the row no bad input may lose)."""
    app = safe_app(make_app)
    result = app.tasks["bad.record"].apply_async(("keep me",), countdown=3600)
    return app, result.id


def assert_kept(app: Celery, task_id: str) -> None:
    row = get_store(app).get(task_id)
    assert row is not None, "a bad input lost an already stored row"
    assert row.status == C.STATUS_PENDING
    assert json.loads(row.payload)["args"] == ["keep me"]


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[str]:
    """A throwaway redis-server with ``--requirepass``; yields its URL with the right password."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(port=free_port(), dir=str(tmp_path), password=PASSWORD).start()
    yield server.url
    server.stop()


def failed_beat_startup(processes: ProcessManager, tmp_path: Path, env: dict[str, str], *args: str) -> str:
    """Run ``celery beat -S SafeScheduler`` on the beat test app; assert it exits non-zero; its output."""
    out = processes.command(
        "tests.apps.beat_app",
        *("beat", "-S", "celery_safe_time.SafeScheduler", "-s", str(tmp_path / "s"), *args),
        env=env,
        timeout=90,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    return text


def wrong_password(url: str) -> str:
    return url.replace(PASSWORD, WRONG)


def no_secret(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text, f"a password leaked:\n{text[-3000:]}"
        assert WRONG not in text, f"a (wrong) password leaked:\n{text[-3000:]}"


# --- settings ------------------------------------------------------------------------------

BAD_SETTINGS = [
    ("safe_time_beat_lease", "soon"),
    ("safe_time_beat_lease", -5),
    ("safe_time_misfire", "sometimes"),
    ("safe_time_misfire_grace", float("nan")),
    ("safe_time_sweep_batch", 0),
    ("safe_time_sweep_batch", "500"),
    ("safe_time_sweep_interval", "5s"),
    ("safe_time_redis_url", "http://127.0.0.1:6379/0"),
    ("safe_time_redis_url", 6379),
    ("safe_time_store_url", "ftp://db/x"),
    ("safe_time_store_url", ""),
    ("safe_time_allow_pickle", "yes"),
    ("safe_time_key_prefix", ""),
    ("safe_time_sweep_queue", 7),
    ("safe_time_delay_threshold", 10_000),  # at/above the Redis visibility timeout (3600 s)
    ("safe_time_lock_ttl", True),
    ("safe_time_delay_retention", -1),
]


@pytest.mark.parametrize(("key", "value"), BAD_SETTINGS, ids=[f"{k}={v!r}" for k, v in BAD_SETTINGS])
def test_malformed_setting_through_install_names_the_key(make_app: Callable[..., Celery], key: str, value: Any) -> None:
    app = make_app("bad-settings", **{key: value})
    with pytest.raises(ImproperlyConfigured) as info:
        install(app)
    assert info.value.key == key
    assert key in str(info.value)


def test_malformed_setting_through_celery_worker_startup(processes: ProcessManager) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_sweep_batch": -1})}
    out = processes.command(FAULTS_APP, "worker", "-l", "INFO", "--without-gossip", env=env, timeout=90)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "ImproperlyConfigured" in text
    assert "safe_time_sweep_batch: must be a positive integer, got -1" in text


def test_malformed_setting_through_celery_beat_startup(processes: ProcessManager, tmp_path: Path) -> None:
    # beat_app does not call install(): the scheduler itself validates at startup.
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_misfire": "twice"})}
    text = failed_beat_startup(processes, tmp_path, env)
    assert "safe_time_misfire: must be one of run_all, run_once, skip, got 'twice'" in text


def test_lease_too_short_for_the_tick_refuses_beat(processes: ProcessManager, tmp_path: Path) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_beat_lease": 1})}
    text = failed_beat_startup(processes, tmp_path, env, "--max-interval", "1")
    assert "safe_time_beat_lease" in text


# --- crontab ---------------------------------------------------------------------------------

BAD_CRONTABS: list[tuple[dict[str, Any], str]] = [
    ({"minute": "61"}, "minute='61'"),
    ({"minute": "*/0"}, "minute='*/0'"),
    ({"hour": "25"}, "hour='25'"),
    ({"hour": "x"}, "hour='x'"),
    ({"day_of_week": "funday"}, "day_of_week='funday'"),
    ({"day_of_month": "0"}, "day_of_month='0'"),
    ({"month_of_year": "13"}, "month_of_year='13'"),
    ({"minute": 5, "tz": "Mars/Olympus_Mons"}, "Mars/Olympus_Mons"),
    ({"minute": 5, "tz": "../../etc/passwd"}, "../../etc/passwd"),
    ({"minute": 5, "tz": 3}, "tz"),
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_CRONTABS, ids=[json.dumps(k) for k, _ in BAD_CRONTABS])
def test_invalid_crontab_field_or_zone_names_it(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ScheduleError) as info:
        crontab(**kwargs)
    assert named in str(info.value)


def test_broken_beat_entry_is_disabled_by_name_others_fire(
    processes: ProcessManager, redis_client: redis.Redis
) -> None:
    schedule = {
        "good": {"task": "tests.record", "every": 1, "args": ["good"]},
        "ghost": {"task": "no.such.task", "every": 1},
        "weird": {"task": "tests.record", "raw": "every tuesday"},
    }
    env = {"SAFE_TIME_TEST_BEAT_SCHEDULE": json.dumps(schedule), "SAFE_TIME_TEST_APP_CONF": json.dumps({})}
    processes.worker("tests.apps.beat_app", env=env, name="w")
    beat = processes.beat("tests.apps.beat_app", env=env, name="b")
    beat.wait_for_log(r"entry 'ghost' is disabled: unknown task 'no.such.task'", timeout=90)
    beat.wait_for_log(r"entry 'weird' is disabled", timeout=30)
    from tests.helpers.processes import wait_for

    wait_for(lambda: redis_client.llen("test:runs") >= 2, 60, message="the good entry fires")
    assert beat.alive()


# --- delayed-task payloads -----------------------------------------------------------------


def test_unserializable_arguments_fail_at_the_call_and_store_nothing(stored: tuple[Celery, str]) -> None:
    app, kept = stored
    before = get_store(app).counts()
    with pytest.raises(SerializationError) as info:
        app.tasks["bad.record"].apply_async((object(),), countdown=3600)
    assert "json" in str(info.value)
    assert "object" in str(info.value)
    with pytest.raises(SerializationError):
        app.tasks["bad.record"].apply_async((1,), countdown=3600, serializer="pickle")
    assert get_store(app).counts() == before
    assert_kept(app, kept)


def test_huge_payload_is_stored_published_and_intact(stored: tuple[Celery, str], redis_client: redis.Redis) -> None:
    """Decision: no size limit of our own. 1 MB of arguments is one row (bytes column) and one
    broker message, like the same call to plain Celery; the database and broker limits apply."""
    app, kept = stored
    big = "x" * (1024 * 1024)
    result = app.tasks["bad.record"].apply_async((big,), countdown=3600)
    row = get_store(app).get(result.id)
    assert row is not None
    assert len(row.payload) > 1024 * 1024
    assert json.loads(row.payload)["args"] == [big]
    get_store(app).reschedule(result.id, utcnow() - timedelta(seconds=1))
    stats = sweep(app)
    assert stats.sent == 1
    assert stats.failed == 0
    assert get_store(app).get(result.id).status == C.STATUS_SENT  # type: ignore[union-attr]
    messages = [m for m in redis_client.lrange("celery", 0, -1) if result.id.encode() in m]
    assert len(messages) == 1
    assert len(messages[0]) > 1024 * 1024
    assert_kept(app, kept)


def _insert_rows(app: Celery, *delays: Any) -> None:
    store = get_store(app)
    for d in delays:
        store.insert(d)


def test_unknown_task_in_a_stored_row_is_marked_failed_naming_it(stored: tuple[Celery, str]) -> None:
    app, kept = stored
    past = utcnow() - timedelta(seconds=5)
    _insert_rows(
        app,
        new_delay("ghost-1", past, task="removed.in.last.deploy"),
        new_delay("fine-1", past, task="bad.record"),
    )
    stats = sweep(app)
    assert (stats.sent, stats.failed) == (1, 1)
    ghost = get_store(app).get("ghost-1")
    assert ghost is not None
    assert ghost.status == C.STATUS_FAILED
    assert "unknown task 'removed.in.last.deploy'" in (ghost.last_error or "")
    assert get_store(app).get("fine-1").status == C.STATUS_SENT  # type: ignore[union-attr]
    assert_kept(app, kept)


CORRUPT = [
    ("garbage", {"payload": b"\x00\xff not json {", "content_type": "application/json"}, "corrupt payload"),
    ("not-a-call", {"payload": b"[1, 2, 3]", "content_type": "application/json"}, "not a stored call"),
    (
        "bad-options",
        {"payload": b'{"args": [], "options": 5}', "content_type": "application/json"},
        "not a stored call",
    ),
    (
        "pickle",
        {"payload": b"\x80\x04K\x01.", "content_type": "application/x-python-serialize", "content_encoding": "binary"},
        "pickle",
    ),
    ("unknown-type", {"payload": b"??", "content_type": "application/x-made-up"}, "application/x-made-up"),
]


@pytest.mark.parametrize(("name", "fields", "error"), CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_row_is_marked_failed_and_the_sweep_goes_on(
    stored: tuple[Celery, str], name: str, fields: dict[str, Any], error: str
) -> None:
    app, kept = stored
    past = utcnow() - timedelta(seconds=5)
    _insert_rows(
        app, new_delay(f"bad-{name}", past, task="bad.record", **fields), new_delay("ok", past, task="bad.record")
    )
    stats = sweep(app)
    assert (stats.sent, stats.failed) == (1, 1)
    row = get_store(app).get(f"bad-{name}")
    assert row is not None
    assert row.status == C.STATUS_FAILED
    assert error in (row.last_error or ""), row.last_error
    assert_kept(app, kept)


# --- lock keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("decorator", [overlap_lock, idempotent], ids=["overlap_lock", "idempotent"])
def test_lock_key_template_with_a_missing_field_fails_at_decoration(decorator: Any) -> None:
    with pytest.raises(ValueError) as info:

        @decorator("sync:{acount}:{period}")
        def sync(account: int, period: str = "now") -> None: ...

    text = str(info.value)
    assert "'acount'" in text
    assert "account" in text
    assert "sync" in text
    assert "'period'" not in text.split("names", 1)[1].split("which")[0]


def test_lock_key_positional_field_fails_at_decoration() -> None:
    with pytest.raises(ValueError, match="must name parameters"):

        @overlap_lock("sync:{0}")
        def sync(account: int) -> None: ...


# --- Redis with a password ------------------------------------------------------------------


def test_wrong_redis_password_locks_raise_a_clear_error(
    make_app: Callable[..., Celery], password_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app("wrong-pw", safe_time_redis_url=wrong_password(password_redis))
    install(app)

    @app.task(name="bad.locked", shared=False)
    @overlap_lock("acct:{account}", on_backend_error="raise")
    def locked(account: int) -> int:
        return account

    with pytest.raises(RedisUnavailable) as info:
        locked(1)
    text = str(info.value)
    assert "acct:1" in text, text
    assert "(Redis redis://:***@127.0.0.1:" in text, text
    assert re.search(r"(?i)password|auth", text), text
    no_secret(text, caplog.text)


def test_wrong_redis_password_beat_exits_naming_redis_masked(
    processes: ProcessManager, password_redis: str, tmp_path: Path
) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_redis_url": wrong_password(password_redis)})}
    text = failed_beat_startup(processes, tmp_path, env)
    assert "unreachable at startup" in text, text
    assert ":***@127.0.0.1" in text, text
    assert re.search(r"(?i)invalid (username-)?password|auth", text), text
    no_secret(text)


def test_check_with_wrong_redis_password_fails_masked(processes: ProcessManager, password_redis: str) -> None:
    env = {"SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_redis_url": wrong_password(password_redis)})}
    out = processes.command(FAULTS_APP, "safe-time", "check", env=env, timeout=90)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert re.search(r"FAIL\s+redis\s+redis://:\*\*\*@127\.0\.0\.1", text), text
    no_secret(text)


def test_password_bearing_urls_never_appear_in_logs_or_cli_output(
    processes: ProcessManager, password_redis: str, postgres_url: str
) -> None:
    """Broker, lock Redis and store URLs all carry passwords; run beat, worker and every
    read-only command, then grep everything they printed."""
    pg = postgres_url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://postgres:{PASSWORD}@", 1)
    assert PASSWORD in pg
    env = {
        "SAFE_TIME_TEST_BROKER_URL": password_redis,
        "SAFE_TIME_TEST_STORE_URL": pg,
        "SAFE_TIME_TEST_RECORD_URL": password_redis,
        "SAFE_TIME_TEST_APP_CONF": json.dumps({"safe_time_sweep_interval": 1}),
    }
    # DEBUG: an idle sweep's "succeeded" line is a DEBUG line (issue 21), and more lines to check.
    worker = processes.worker(FAULTS_APP, "-l", "DEBUG", env=env, name="pw-worker")
    beat = processes.beat(FAULTS_APP, env=env, name="pw-beat")
    worker.wait_for_log(r"ready\.", timeout=90)
    beat.wait_for_log(r"acquired the leader lease", timeout=90)
    worker.wait_for_log(r"celery_safe_time\.sweep.*succeeded", timeout=60)
    outputs = []
    for args in (
        ("safe-time", "check"),
        ("safe-time", "status"),
        ("safe-time", "delays", "list"),
        ("safe-time", "locks", "list"),
        ("report",),
        ("inspect", "stats", "--timeout", "3"),
    ):
        out = processes.command(FAULTS_APP, *args, env=env, timeout=90)
        outputs.append(f"$ {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}")
    # and with the wrong password on every URL
    bad_env = {k: wrong_password(v) for k, v in env.items()}
    for args in (("safe-time", "check"), ("safe-time", "status")):
        out = processes.command(FAULTS_APP, *args, env=bad_env, timeout=90)
        outputs.append(f"$ {' '.join(args)} (wrong password) -> {out.returncode}\n{out.stdout}{out.stderr}")
    beat.terminate()
    worker.terminate()
    joined = "\n".join(outputs)
    assert ":***@" in joined  # the URLs are shown, masked
    no_secret(worker.log(), beat.log(), joined)


# --- missing database -----------------------------------------------------------------------


def test_store_url_to_a_missing_database_raises_naming_it(
    make_app: Callable[..., Celery], postgres_url: str, processes: ProcessManager
) -> None:
    missing = postgres_url.rsplit("/", 1)[0] + "/safe_time_no_such_db_4711"
    app = safe_app(make_app, safe_time_store_url=missing)
    with pytest.raises(StoreError) as info:
        app.tasks["bad.record"].apply_async((1,), countdown=3600)
    assert 'database "safe_time_no_such_db_4711" does not exist' in str(info.value)
    # a short delay never touches the store: it still goes to the broker
    app.tasks["bad.record"].apply_async((1,), countdown=1)
    reset_store(app)
    env = {"SAFE_TIME_TEST_STORE_URL": missing}
    out = processes.command(FAULTS_APP, "safe-time", "check", env=env, timeout=90)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert re.search(r"FAIL\s+store\s+.*safe_time_no_such_db_4711", text), text


def test_sqlite_store_in_a_missing_directory_raises_naming_it(make_app: Callable[..., Celery], tmp_path: Path) -> None:
    app = safe_app(make_app, safe_time_store_url=f"sqlite:///{tmp_path}/no/such/dir/x.sqlite3")
    with pytest.raises(StoreError) as info:
        app.tasks["bad.record"].apply_async((1,), countdown=3600)
    assert "no/such/dir/x.sqlite3" in str(info.value)


# --- SQL injection -------------------------------------------------------------------------

SQL_SINKS = {"execute", "exec_driver_sql", "text", "raw", "extra", "executescript", "executemany"}


def _string_built(node: ast.AST) -> bool:
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Add)):
        return not (isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant))
    return bool(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("format", "join")
    )


def test_no_string_built_sql_in_the_package() -> None:
    """Scan every module: the SQL argument of execute()/text()/raw()... is never an f-string,
    ``%``/``+`` concatenation or ``.format()``, directly or through a local variable."""
    offenders = []
    for path in sorted((ROOT / "celery_safe_time").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
            built: set[str] = set()
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and _string_built(node.value):
                    built |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(func):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name not in SQL_SINKS:
                    continue
                arg = node.args[0]
                if _string_built(arg) or (isinstance(arg, ast.Name) and arg.id in built):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:120]}")
    assert not offenders, "string-built SQL:\n" + "\n".join(sorted(set(offenders)))


METACHARS = ["'); DROP TABLE celery_safe_time_delay; --", "x' OR '1'='1", 'a"b\\c;%s%%{0}', "Robert'); --\x00"]


_BACKEND_URL_FIXTURES = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "mysql": "mysql_url"}


@pytest.mark.parametrize("backend", sorted(_BACKEND_URL_FIXTURES))
def test_sql_metacharacters_are_stored_as_data(
    make_app: Callable[..., Celery], backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(_BACKEND_URL_FIXTURES[backend])
    # The server databases live for the whole session: start from an empty table (rows are counted).
    fresh_sql_store(url).close()
    app = safe_app(make_app, safe_time_store_url=url)
    keep = app.tasks["bad.record"].apply_async(("keep me",), countdown=3600)
    ids = []
    for i, evil in enumerate(METACHARS):
        evil_text = evil.replace("\x00", "") if backend == "postgresql" else evil
        task_id = f"{evil_text}-{i}"
        result = app.tasks["bad.record"].apply_async(
            (evil,), {"k": evil}, countdown=3600, task_id=task_id, idempotency_key=f"key:{evil_text}"
        )
        assert result.id == task_id
        ids.append(task_id)
        row = get_store(app).get(task_id)
        assert row is not None
        assert json.loads(row.payload)["args"] == [evil]
        assert row.idempotency_key == f"caller:bad.record:key:{evil_text}"
        # the same key again: found as data, not as SQL
        again = app.tasks["bad.record"].apply_async((evil,), countdown=3600, idempotency_key=f"key:{evil_text}")
        assert again.id == task_id
    store = get_store(app)
    assert isinstance(store, SQLAlchemyStore)
    assert sa.inspect(store.engine).has_table(C.DELAY_TABLE)
    assert store.counts()[C.STATUS_PENDING] == len(METACHARS) + 1
    assert store.list(task="bad.record' OR '1'='1") == []
    assert store.cancel(ids[0])
    assert not store.cancel("x' OR '1'='1")
    assert_kept(app, keep.id)
    assert get_config(app).store_url == url


def test_celery_report_masks_the_safe_time_urls() -> None:
    """``celery report`` (``app.conf.humanize(censored=True)``) printed ``safe_time_store_url`` and
    ``safe_time_redis_url`` with their passwords before the package extended Celery's list."""
    app = Celery("report", set_as_current=False)
    app.conf.update(
        safe_time_store_url=f"postgresql://app:{PASSWORD}@db/app",
        safe_time_redis_url=f"redis://:{PASSWORD}@cache:6379/0",
        CELERY_SAFE_TIME_STORE_URL=f"postgresql://app:{PASSWORD}@db/app",
    )
    text = app.conf.humanize(with_defaults=False, censored=True) + app.bugreport()
    assert "safe_time_store_url" in text
    no_secret(text)
    app.close()


def test_a_warning_raised_as_an_error_while_publishing_fails_no_row(make_app: Callable[..., Celery]) -> None:
    """Under ``-W error`` (this suite's filter) a warning is an exception. Two callables under one name
    make the app's first task lookup (in the sweep's publish) raise Celery's DuplicateTaskNameWarning:
    that is the process's, not the row's; the row goes back to pending and the next sweep sends it."""
    app = make_app("bad-input-warning")
    install(app)

    @app.task(name="dup.name", shared=False)
    def first() -> None: ...

    @app.task(name="dup.name", shared=False)
    def second() -> None: ...

    _insert_rows(app, new_delay("warned-1", utcnow() - timedelta(seconds=5), task="dup.name"))
    stats = sweep(app)
    assert stats.failed == 0
    row = get_store(app).get("warned-1")
    assert row is not None
    assert row.status == C.STATUS_PENDING, row.last_error
    stats = sweep(app)  # Celery warns once per name
    assert (stats.sent, stats.failed) == (1, 0)
    assert get_store(app).get("warned-1").status == C.STATUS_SENT  # type: ignore[union-attr]
