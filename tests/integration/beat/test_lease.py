"""The lease and guard scripts against a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_safe_time import signals
from celery_safe_time.beat.backends.base import SlotWrite
from celery_safe_time.beat.backends.redis import Lease
from celery_safe_time.beat.leader import LeaderKeeper
from celery_safe_time.clock import RedisClock
from celery_safe_time.config import get_config
from tests.helpers.processes import wait_for
from tests.helpers.services import RedisServer

pytestmark = pytest.mark.integration


def _lease(make_app: Any, redis_client: redis.Redis, **conf: Any) -> Lease:
    return Lease(redis_client, get_config(make_app(safe_time_beat_lease=6, **conf)))


def test_acquire_renew_release(make_app: Any, redis_client: redis.Redis) -> None:
    a, b = _lease(make_app, redis_client), _lease(make_app, redis_client)
    assert a.acquire(0.0) == 1
    assert b.acquire(0.0) is None
    assert a.acquire(0.0) == 1  # re-acquiring our own lease keeps the epoch
    assert a.renew()
    assert not b.renew()
    assert 0 < redis_client.pttl("safe_time:beat:lease") <= 6000
    assert not b.release()
    assert a.release()
    assert b.acquire(0.0) == 2  # a new lease, a new epoch


def test_guard_publishes_each_slot_once_and_only_for_the_leader(make_app: Any, redis_client: redis.Redis) -> None:
    a, b = _lease(make_app, redis_client), _lease(make_app, redis_client)
    epoch = a.acquire(0.0)
    assert epoch is not None
    assert a.dispatch(epoch, "e", 100.0, "{}", 110.0) == 1
    assert a.dispatch(epoch, "e", 100.0, "{}", 110.0) == 0
    assert redis_client.ttl("safe_time:beat:fired:e:100000") > 6 * 86400
    assert b.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1  # right epoch, wrong token
    redis_client.delete("safe_time:beat:lease")
    assert a.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1
    assert b.acquire(0.0) == epoch + 1
    assert a.dispatch(epoch, "e", 110.0, "{}", 120.0) == -1  # stale epoch
    assert b.dispatch_slot(epoch + 1, "e", 100.0) == 0  # fired markers survive leaders
    assert redis_client.zscore("safe_time:beat:due", "e") == 110.0


def test_write_slots_one_round_trip_same_verdicts(make_app: Any, redis_client: redis.Redis) -> None:
    a, b = _lease(make_app, redis_client), _lease(make_app, redis_client)
    epoch = a.acquire(0.0)
    assert epoch is not None
    writes = [
        SlotWrite("x", '{"last": 100}', 110.0, 100.0),
        SlotWrite("x", '{"last": 100}', 110.0, 100.0),  # the same slot again: already fired
        SlotWrite("y", '{"last": 5}', 205.0),  # advance only
        SlotWrite("z", '{"last": 300}', 310.0, 300.0),
    ]
    assert a.write_slots(epoch, writes) == [1, 0, 1, 1]
    assert redis_client.zscore("safe_time:beat:due", "y") == 205.0
    assert redis_client.hget("safe_time:beat:state", "z") == b'{"last": 300}'
    assert b.write_slots(epoch, [SlotWrite("z", "{}", 320.0, 310.0), SlotWrite("y", "{}", 210.0)]) == [-1, -1]
    assert redis_client.zscore("safe_time:beat:due", "y") == 205.0  # the standby wrote nothing


def test_write_slots_after_redis_lost_its_scripts(make_app: Any, redis_server: RedisServer) -> None:
    """Redis lost its scripts (a restart, ``SCRIPT FLUSH``): NOSCRIPT replies are loaded and run again
    once. On a server of its own: ``SCRIPT FLUSH`` reaches every client of a server."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        a = _lease(make_app, client)
        epoch = a.acquire(0.0)
        assert epoch is not None
        assert a.write_slots(epoch, [SlotWrite("z", '{"last": 300}', 310.0, 300.0)]) == [1]
        client.script_flush()
        writes = [SlotWrite("z", "{}", 320.0, 310.0), SlotWrite("z", "{}", 320.0, 300.0)]
        assert a.write_slots(epoch, writes) == [1, 0]
        assert client.zscore("safe_time:beat:due", "z") == 320.0
    finally:
        client.close()


def test_keeper_signals_and_steps_down(make_app: Any, redis_client: redis.Redis) -> None:
    app = make_app(safe_time_beat_lease=3)
    config = get_config(app)
    events: list[tuple[str, Any]] = []

    def acquired(sender: Any, epoch: int, **kw: Any) -> None:
        events.append(("acquired", epoch))

    def lost(sender: Any, epoch: int, reason: str, **kw: Any) -> None:
        events.append(("lost", epoch))

    signals.beat_lease_acquired.connect(acquired, weak=False)
    signals.beat_lease_lost.connect(lost, weak=False)
    keeper = LeaderKeeper(Lease(redis_client, config), RedisClock(redis_client), config, sender=None)
    try:
        keeper.start()
        assert keeper.epoch == 1
        redis_client.delete("safe_time:beat:lease")
        wait_for(lambda: keeper.epoch == 2, 10, message="a new epoch after the lease was deleted")
        assert events[:3] == [("acquired", 1), ("lost", 1), ("acquired", 2)]
    finally:
        keeper.stop()
        signals.beat_lease_acquired.disconnect(acquired)
        signals.beat_lease_lost.disconnect(lost)
    assert redis_client.get("safe_time:beat:lease") is None


def test_a_dispatch_sent_again_after_a_lost_reply_still_publishes(make_app: Any, redis_client: redis.Redis) -> None:
    # redis-py sends a timed-out command again whatever retry_on_timeout says: the same script with
    # the same arguments. The slot was marked by the first attempt and never published, so the second
    # must answer "publish"; a later dispatch of that slot (another call) still answers "already fired".
    lease = _lease(make_app, redis_client)
    epoch = lease.acquire(0.0)
    assert epoch is not None
    script, keys, args = lease._write_call(epoch, SlotWrite("e", "{}", 110.0, 100.0), "1:retried")
    assert script(keys=keys, args=args) == 1
    assert script(keys=keys, args=args) == 1  # the retry of that call
    assert lease.dispatch(epoch, "e", 100.0, "{}", 110.0) == 0
    slot_keys = [lease.keys.lease, lease.keys.epoch, "safe_time:beat:fired:e:200000"]
    slot_args = [lease.token, epoch, 60_000, "1:slot"]
    assert lease.scripts["dispatch_slot"](keys=slot_keys, args=slot_args) == 1
    assert lease.scripts["dispatch_slot"](keys=slot_keys, args=slot_args) == 1
    assert lease.dispatch_slot(epoch, "e", 200.0) == 0
