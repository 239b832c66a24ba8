"""The lean script path's own protocol code: packing EVALSHA and parsing the replies scripts send."""

from __future__ import annotations

import pytest
import redis

from celery_safe_time.locks.redis_wire import Incomplete, Unexpected, pack_evalsha, parse_reply


def test_pack_evalsha_matches_what_redis_py_packs() -> None:
    sha = b"a" * 40
    keys = ["lock:k", "fence:k", "done:k:é"]
    args: list[str | int | bytes] = ["tok", 30000, b"\x00raw", -5, ""]
    expected = redis.Connection().pack_command("EVALSHA", sha, 3, *keys, *args)
    assert pack_evalsha(sha, keys, args) == b"".join(expected)


@pytest.mark.parametrize("bad", [1.5, True, None, object()])
def test_pack_evalsha_refuses_what_redis_py_would_not_send_as_is(bad: object) -> None:
    with pytest.raises(redis.DataError, match="invalid script argument"):
        pack_evalsha(b"a" * 40, ["k"], ["tok", bad])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("wire", "value"),
    [
        (b"*3\r\n$8\r\nacquired\r\n:17\r\n$3\r\nnew\r\n", [b"acquired", 17, b"new"]),
        (b":0\r\n", 0),
        (b":-3\r\n", -3),
        (b"$-1\r\n", None),
        (b"_\r\n", None),
        (b"*-1\r\n", None),
        (b"*0\r\n", []),
        (b"$0\r\n\r\n", b""),
        (b"+OK\r\n", b"OK"),
        (b"*2\r\n*1\r\n:1\r\n$4\r\na\r\nb\r\n", [[1], b"a\r\nb"]),
        (b"*5\r\n$4\r\nheld\r\n$2\r\nt1\r\n$1\r\nh\r\n$-1\r\n:9\r\n", [b"held", b"t1", b"h", None, 9]),
    ],
)
def test_parse_reply_reads_every_type_the_scripts_answer_with(wire: bytes, value: object) -> None:
    assert parse_reply(wire) == (value, len(wire))


def test_parse_reply_asks_for_more_at_every_cut_of_a_reply() -> None:
    wire = b"*3\r\n$8\r\nacquired\r\n:17\r\n$3\r\nnew\r\n"
    for cut in range(len(wire)):
        with pytest.raises(Incomplete):
            parse_reply(wire[:cut])


@pytest.mark.parametrize("wire", [b"-NOSCRIPT No matching script\r\n", b"-ERR boom\r\n", b">2\r\n$4\r\npush\r\n:1\r\n"])
def test_parse_reply_leaves_errors_and_pushes_to_redis_py(wire: bytes) -> None:
    with pytest.raises(Unexpected):
        parse_reply(wire)
