"""Every Lua script ships as a package resource, is loaded through ``load_script`` and runs on a real Redis."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import redis

from celery_safe_time.beat.backends import redis as beat_redis
from celery_safe_time.locks.backends import redis as lock_redis
from celery_safe_time.redis_client import load_script

pytestmark = pytest.mark.integration

PACKAGES = {"celery_safe_time.beat": beat_redis.SCRIPTS, "celery_safe_time.locks": lock_redis.SCRIPTS}


def _shipped(package: str) -> set[str]:
    return {
        p.name[: -len(".lua")] for p in resources.files(package).joinpath("lua").iterdir() if p.name.endswith(".lua")
    }


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_lua_file_is_a_loaded_script_and_every_script_has_a_file(package: str) -> None:
    # A ``_`` file is shared Lua, put before the scripts that call it rather than run on its own.
    scripts = {name for name in _shipped(package) if not name.startswith("_")}
    assert scripts == set(PACKAGES[package])


def test_every_shared_beat_file_is_a_prelude_and_every_prelude_has_a_file() -> None:
    shared = {name for name in _shipped("celery_safe_time.beat") if name.startswith("_")}
    preludes = {part for parts in beat_redis.PRELUDES.values() for part in parts}
    assert shared == preludes
    assert set(beat_redis.PRELUDES) <= set(beat_redis.SCRIPTS)


def _run(client: redis.Redis, package: str, name: str, keys: list[str], args: list[object]) -> object:
    source = beat_redis.script_source(name) if package == "celery_safe_time.beat" else load_script(package, name)
    return client.register_script(source)(keys=keys, args=args)


def test_beat_scripts_run(redis_client: redis.Redis) -> None:
    beat = "celery_safe_time.beat"
    keys = ["t:lease", "t:epoch", "t:info"]
    assert _run(redis_client, beat, "acquire", keys, ["tok", 5000, json.dumps({"host": "h"})]) == 1
    assert _run(redis_client, beat, "acquire", keys, ["other", 5000, "{}"]) == -1
    assert json.loads(redis_client.get("t:info") or b"{}")["epoch"] == 1
    assert _run(redis_client, beat, "renew", keys, ["tok", 5000, 1]) == 1
    assert _run(redis_client, beat, "renew", keys, ["tok", 5000, 2]) == 0  # wrong epoch
    dispatch_keys = ["t:lease", "t:epoch", "t:fired", "t:state", "t:due"]
    args = ["tok", 1, 60000, "entry", '{"last": 1}', "20.0", "1:a"]
    assert _run(redis_client, beat, "dispatch", dispatch_keys, args) == 1
    assert _run(redis_client, beat, "dispatch", dispatch_keys, args) == 1  # the same call again (a retry)
    assert _run(redis_client, beat, "dispatch", dispatch_keys, [*args[:-1], "1:b"]) == 0  # slot already fired
    assert redis_client.zscore("t:due", "entry") == 20.0
    assert _run(redis_client, beat, "dispatch_slot", ["t:lease", "t:epoch", "t:fired2"], ["tok", 1, 60000, "1"]) == 1
    assert _run(redis_client, beat, "dispatch_slot", ["t:lease", "t:epoch", "t:fired2"], ["no", 1, 60000, "1"]) == -1
    advance_keys = ["t:lease", "t:epoch", "t:state", "t:due"]
    assert _run(redis_client, beat, "advance", advance_keys, ["tok", 1, "entry", "{}", "30.0"]) == 1
    assert redis_client.zscore("t:due", "entry") == 30.0
    assert _run(redis_client, beat, "release", ["t:lease", "t:info"], ["other"]) == 0
    assert _run(redis_client, beat, "release", ["t:lease", "t:info"], ["tok"]) == 1
    assert redis_client.exists("t:lease", "t:info") == 0


def test_beat_history_writes_a_run_and_drops_the_oldest_beyond_the_size(redis_client: redis.Redis) -> None:
    beat = "celery_safe_time.beat"
    redis_client.set("t:lease", "tok")
    redis_client.set("t:epoch", 1)
    history = ["t:hist", "t:slots"]
    for slot in (1000, 2000):
        keys = ["t:lease", "t:epoch", f"t:fired:{slot}", "t:state", "t:due", *history]
        args = ["tok", 1, 60000, "entry", "{}", "30.0", "1:a", f"run-{slot}", 2, slot]
        assert _run(redis_client, beat, "dispatch", keys, args) == 1
    redis_client.hset("t:hist", "1000:o", "outcome")
    assert _run(redis_client, beat, "history_record", history, [3000, "run-3000", 2]) == 1
    assert redis_client.hgetall("t:hist") == {b"2000": b"run-2000", b"3000": b"run-3000"}
    assert redis_client.zrange("t:slots", 0, -1) == [b"2000", b"3000"]


def test_lock_scripts_run(redis_client: redis.Redis) -> None:
    locks = "celery_safe_time.locks"
    keys = ["t:lock", "t:fence", "t:done:id:0:0"]
    acquired = _run(redis_client, locks, "acquire", keys, ["tok", 5000, "id", "h", 1, "id:0:0"])
    assert acquired[0] == b"acquired"
    assert acquired[2] == b"new"
    fence = int(acquired[1])
    assert fence > 10**15  # a new counter starts at Redis TIME in microseconds
    held = _run(
        redis_client, locks, "acquire", ["t:lock", "t:fence", "t:done:id2"], ["tok2", 5000, "id2", "h", 2, "i2"]
    )
    assert held == [b"held", b"id", b"h", b"1", str(fence).encode()]
    duplicate = _run(redis_client, locks, "acquire", keys, ["tok3", 5000, "id", "h", 3, "id:0:0"])
    assert duplicate[0] == b"duplicate"
    # A copy carrying the token its earlier attempt set (a lost reply) takes the lock over, same fence.
    own = _run(redis_client, locks, "acquire", keys, ["tok4", 5000, "id", "h", 4, "id:0:0", "tok"])
    assert own == [b"acquired", str(fence).encode(), b"own"]
    assert _run(redis_client, locks, "renew", ["t:lock", "t:fence"], ["tok4", 9000]) == 1
    assert redis_client.pttl("t:fence") > 5000  # the counter lives as long as the renewed lock
    assert _run(redis_client, locks, "renew", ["t:lock", "t:fence"], ["tok2", 9000]) == 0
    assert _run(redis_client, locks, "release", ["t:lock"], ["tok2"]) == 0
    assert _run(redis_client, locks, "release", ["t:lock", "t:done:id:0:0"], ["tok4", 60000, "id"]) == 1
    assert _run(redis_client, locks, "acquire", keys, ["tok5", 5000, "id", "h", 5, "id:0:0"]) == [b"finished"]
    idem = ["t:lock2", "t:fence2", "t:done2", "t:marker"]
    assert _run(redis_client, locks, "acquire", idem, ["t6", 5000, "i", "h", 1, "i:0:0"])[0] == b"acquired"
    assert _run(redis_client, locks, "commit", ["t:lock2", "t:marker"], ["t6", 60000, "i", 60000]) == [1, 1]
    assert _run(redis_client, locks, "commit", ["t:lock2", "t:marker"], ["t6", 60000, "i", 60000]) == [1, 0]
    assert _run(redis_client, locks, "acquire", idem, ["t7", 5000, "j", "h", 1, "j:0:0"]) == [b"done"]
