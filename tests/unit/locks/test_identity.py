"""Which delivery a request is (issue 13): the attempt header, carried across our own re-queues,
not across ``retry()``; lost-reply tokens in the re-queue header; how long a finished delivery
is remembered."""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

from celery_safe_time import constants as C
from celery_safe_time.config import parse_config
from celery_safe_time.locks import runtime
from celery_safe_time.locks.runtime import (
    LOCK_DONE_TTL,
    LOCK_DONE_TTL_MARGIN,
    LOCK_ORIGIN_MAX_TOKENS,
    delivery_identity,
    done_ttl,
    origin_header,
)


def request(headers: dict[str, Any] | None = None, retries: int = 0, task_id: str = "t-1") -> Context:
    return Context(id=task_id, retries=retries, headers=headers or None)


def requeued(of: Context, attempt: str) -> Context:
    """What our re-queue publishes: the request's headers, the origin header, a fresh attempt."""
    headers = dict(of.headers or {})
    headers[C.HEADER_LOCK_ORIGIN] = origin_header(of)
    headers[C.HEADER_ATTEMPT] = attempt
    return request(headers, retries=of.retries, task_id=of.id)


def test_the_attempt_header_is_the_identity_and_a_redelivery_keeps_it() -> None:
    first = request({C.HEADER_ATTEMPT: "a1"})
    redelivered = request({C.HEADER_ATTEMPT: "a1"})
    republished = request({C.HEADER_ATTEMPT: "a2"})  # the same task id published again
    assert delivery_identity(first) == delivery_identity(redelivered) == "a1"
    assert delivery_identity(republished) == "a2"


def test_requeued_copies_keep_the_identity_of_the_first_message() -> None:
    first = request({C.HEADER_ATTEMPT: "a1"})
    copy = requeued(first, "a2")
    copy_of_copy = requeued(copy, "a3")
    assert delivery_identity(copy) == delivery_identity(copy_of_copy) == "a1"


def test_retry_copies_the_header_but_is_a_new_delivery() -> None:
    copy = requeued(request({C.HEADER_ATTEMPT: "a1"}), "a2")
    # retry() republishes with the request's custom headers, retries + 1 and a fresh attempt
    retried = request({**(copy.headers or {}), C.HEADER_ATTEMPT: "a3"}, retries=1)
    assert delivery_identity(retried) == "a3"


def test_without_an_attempt_header_the_old_identity_is_the_fallback() -> None:
    assert delivery_identity(request({}, retries=2)) == "t-1:2:0"
    assert delivery_identity(request({C.HEADER_LOCK_REQUEUES: 3}, retries=1)) == "t-1:1:3"


def test_lost_reply_tokens_travel_in_the_requeue_header_per_key() -> None:
    first = request({C.HEADER_ATTEMPT: "a1"})
    setattr(first, runtime._ORPHANS_ATTR, [("k", "tok-1"), ("other", "tok-x")])
    copy = requeued(first, "a2")
    assert runtime._carried_tokens(copy) == [("k", "tok-1"), ("other", "tok-x")]
    setattr(copy, runtime._ORPHANS_ATTR, [("k", "tok-2")])
    again = requeued(copy, "a3")
    assert [t for k, t in runtime._carried_tokens(again) if k == "k"] == ["tok-1", "tok-2"]
    many = request({C.HEADER_ATTEMPT: "a1"})
    setattr(many, runtime._ORPHANS_ATTR, [("k", f"tok-{i}") for i in range(20)])
    kept = runtime._carried_tokens(requeued(many, "a2"))
    assert len(kept) == LOCK_ORIGIN_MAX_TOKENS
    assert kept[-1] == ("k", "tok-19")


def test_a_malformed_origin_header_is_ignored() -> None:
    for bad in ("x", {"identity": ""}, {"identity": "i", "retries": "nope"}, {"identity": "i", "tokens": "x"}):
        req = request({C.HEADER_LOCK_ORIGIN: bad, C.HEADER_ATTEMPT: "a9"})
        assert delivery_identity(req) in ("a9", "i")
        assert runtime._carried_tokens(req) == []


def test_finished_deliveries_are_remembered_past_the_visibility_timeout() -> None:
    def config(broker: str, **transport: Any) -> Any:
        settings = {"safe_time_redis_url": "redis://127.0.0.1:6379/0"}
        return parse_config(settings.get, broker_url=broker, transport_options=transport)

    assert done_ttl(config("amqp://guest@localhost//")) == LOCK_DONE_TTL
    assert done_ttl(config("redis://127.0.0.1:6379/0", visibility_timeout=60)) == LOCK_DONE_TTL
    kombu_default = config("redis://127.0.0.1:6379/0")
    assert done_ttl(kombu_default) == C.KOMBU_DEFAULT_VISIBILITY_TIMEOUT + LOCK_DONE_TTL_MARGIN
    assert done_ttl(config("redis://127.0.0.1:6379/0", visibility_timeout=43200)) == 43200 + LOCK_DONE_TTL_MARGIN
