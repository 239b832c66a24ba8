"""Redis key names: unchanged on plain Redis / Sentinel (a rolling upgrade renames nothing), hash-tagged
on a Redis Cluster so that the keys of every script share one slot."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from redis.cluster import key_slot

from celery_safe_time import constants as C
from celery_safe_time.beat.backends.redis import BeatKeys
from celery_safe_time.config import SafeTimeConfig, parse_config
from celery_safe_time.exceptions import ImproperlyConfigured
from celery_safe_time.locks.backends.redis import RedisLockBackend

CLUSTER = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001/"


def parse(redis_url: str, **settings: Any) -> SafeTimeConfig:
    settings["safe_time_redis_url"] = redis_url
    return parse_config(settings.get, broker_url="redis://127.0.0.1:6379/0", transport_options=None)


class _NoClient:
    def register_script(self, source: str) -> SimpleNamespace:
        return SimpleNamespace(sha="0" * 40)


def _store(config: SafeTimeConfig) -> RedisLockBackend:
    return RedisLockBackend(_NoClient(), config)  # type: ignore[arg-type]


def _slot(name: str) -> int:
    return int(key_slot(name.encode()))


# The names every release so far wrote on plain Redis: a new process must read and write exactly these.
PLAIN_NAMES = {
    (C.KEY_BEAT_LEASE, ()): "safe_time:beat:lease",
    (C.KEY_BEAT_EPOCH, ()): "safe_time:beat:epoch",
    (C.KEY_BEAT_LEADER_INFO, ()): "safe_time:beat:leader",
    (C.KEY_BEAT_STATE, ()): "safe_time:beat:state",
    (C.KEY_BEAT_DUE, ()): "safe_time:beat:due",
    (C.KEY_BEAT_FIRED, (("entry", "e"), ("slot", 100000))): "safe_time:beat:fired:e:100000",
    (C.KEY_BEAT_ENTRIES, ()): "safe_time:beat:entries",
    (C.KEY_BEAT_ENTRIES_VERSION, ()): "safe_time:beat:entries:version",
    (C.KEY_BEAT_ENTRIES_CHANGED, ()): "safe_time:beat:entries:changed",
    (C.KEY_BEAT_ENTRIES_NAMES, ()): "safe_time:beat:entries:names",
    (C.KEY_BEAT_ENTRIES_NAMES_VERSION, ()): "safe_time:beat:entries:names:version",
    (C.KEY_BEAT_RUN_NOW, ()): "safe_time:beat:entries:run-now",
    (C.KEY_LOCK, (("key", "k"),)): "safe_time:lock:k",
    (C.KEY_LOCK_FENCE, (("key", "k"),)): "safe_time:lock-fence:k",
    (C.KEY_IDEMPOTENT, (("key", "k"),)): "safe_time:idem:k",
    (C.KEY_LOCK_DONE, (("key", "k"), ("identity", "t:0:0"))): "safe_time:lock-done:k:t:0:0",
}


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://127.0.0.1:6380/0",
        "unix:///tmp/redis.sock",
        "sentinel://127.0.0.1:26379/0?master=m",
    ],
)
def test_plain_redis_and_sentinel_keep_the_names_of_earlier_releases(url: str) -> None:
    config = parse(url)
    assert not config.redis_cluster
    for (template, parts), name in PLAIN_NAMES.items():
        assert config.key(template, **dict(parts)) == name


def test_cluster_names_carry_the_hash_tags_of_the_key_table() -> None:
    config = parse(CLUSTER)
    assert config.redis_cluster
    assert config.key(C.KEY_BEAT_LEASE) == "safe_time:{beat}:lease"
    assert config.key(C.KEY_BEAT_FIRED, entry="e", slot=1) == "safe_time:{beat}:fired:e:1"
    assert config.key(C.KEY_BEAT_RUN_NOW) == "safe_time:{beat}:entries:run-now"
    assert config.key(C.KEY_LOCK, key="k") == "safe_time:lock:{k}"
    assert config.key(C.KEY_LOCK_FENCE, key="k") == "safe_time:lock-fence:{k}"
    assert config.key(C.KEY_LOCK_DONE, key="k", identity="i") == "safe_time:lock-done:{k}:i"
    assert config.key(C.KEY_IDEMPOTENT, key="k") == "safe_time:idem:{k}"
    assert config.key(C.KEY_LOCK, key="idem:k") == "safe_time:lock:idem:{k}"


def test_every_beat_key_shares_one_slot_on_a_cluster() -> None:
    config = parse(CLUSTER, safe_time_key_prefix="app1:")
    keys = BeatKeys.for_config(config)
    names = [keys.lease, keys.epoch, keys.info, keys.state, keys.due, keys.entries, keys.version]
    names += [keys.changed, keys.run_now, keys.applied, keys.pause_expiry]
    names += [config.key(C.KEY_BEAT_FIRED, entry=e, slot=s) for e in ("a", "x{y}", "}{", "") for s in (0, 17)]
    assert len({_slot(n) for n in names}) == 1
    # Every template under the beat namespace, including ones added later, follows the tag.
    beat_templates = [v for k, v in vars(C).items() if k.startswith("KEY_BEAT_") and isinstance(v, str)]
    for template in beat_templates:
        assert template.startswith(C.KEY_BEAT_NAMESPACE)


@pytest.mark.parametrize(
    "key", ["k", "sync:{account}", "a}b", "{", "}", "}x", "~", "~}", "", "x{y}z", "idem:", "lock:idem:q", "ü"]
)
def test_a_lock_its_fence_markers_and_idempotency_key_share_a_slot(key: str) -> None:
    config = parse(CLUSTER)
    store = _store(config)
    # An overlap lock: lock, fence, finished-delivery marker.
    overlap = {store.lock_key(key), store.fence_key(key), store.done_key(key, "t:0:0")}
    assert len({_slot(n) for n in overlap}) == 1
    # An idempotent key: its in-progress lock lives under the idem: namespace, beside its marker.
    lock = C.IDEMPOTENT_LOCK_NAMESPACE + key
    idem = {store.lock_key(lock), store.fence_key(lock), store.done_key(lock, "t:0:0"), store.marker_key(key)}
    assert len({_slot(n) for n in idem}) == 1
    assert store.user_key(store.lock_key(key)) == key
    assert store.user_key(store.lock_key(lock)) == lock


def test_escaped_keys_stay_distinct() -> None:
    store = _store(parse(CLUSTER))
    keys = ["", "~", "~~", "}", "~}", "}~", "a", "idem:", "idem:~", "idem:}"]
    names = [store.lock_key(k) for k in keys]
    assert len(set(names)) == len(keys)
    assert [store.user_key(n) for n in names] == keys


def test_different_lock_keys_spread_over_the_cluster() -> None:
    store = _store(parse(CLUSTER))
    assert len({_slot(store.lock_key(f"job:{i}")) for i in range(100)}) > 90


@pytest.mark.parametrize("prefix", ["{app}:", "app{:", "app}:"])
def test_a_braced_prefix_is_refused_on_a_cluster(prefix: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="safe_time_key_prefix"):
        parse(CLUSTER, safe_time_key_prefix=prefix)
    assert parse("redis://127.0.0.1:6379/0", safe_time_key_prefix=prefix).key_prefix == prefix


def test_cluster_url_with_a_db_is_refused() -> None:
    from celery_safe_time.redis_client import create_redis

    with pytest.raises(ImproperlyConfigured, match=r"safe_time_redis_url.*only db 0"):
        create_redis("redis+cluster://127.0.0.1:7000/3")


@pytest.mark.parametrize(
    ("url", "prefix"),
    # A cluster refuses a prefix with braces (it would move the hash tag): plain Redis takes any.
    [("redis://127.0.0.1:6379/0", p) for p in ("safe_time:", "app{1}:", "x}{y:")] + [(CLUSTER, "app:")],
)
@pytest.mark.parametrize("key", ["k", "", "a{b}c", "}x", "idem:q", "é:{}"])
def test_key_maker_names_what_key_names(url: str, prefix: str, key: str) -> None:
    """The lock backend's one-call names (``key_maker``) are the names ``key`` gives, braces and all."""
    config = parse(url, safe_time_key_prefix=prefix)
    for template in (C.KEY_LOCK, C.KEY_LOCK_FENCE, C.KEY_IDEMPOTENT):
        assert config.key_maker(template)(key=key) == config.key(template, key=key)
    done = config.key_maker(C.KEY_LOCK_DONE)(key=key, identity="t{1}:0:0")
    assert done == config.key(C.KEY_LOCK_DONE, key=key, identity="t{1}:0:0")
