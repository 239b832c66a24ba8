"""The block-read random tokens: the same form as uuid4, never repeated, not shared with a forked child."""

from __future__ import annotations

import os
import uuid

import pytest

from celery_safe_time.messages.randomness import uuid4_hex, uuid4_str
from celery_safe_time.messages.requeue import new_attempt


def test_tokens_have_the_uuid4_forms() -> None:
    for _ in range(1000):
        h = uuid4_hex()
        u = uuid.UUID(hex=h)
        assert (u.hex, u.version, u.variant) == (h, 4, uuid.RFC_4122)
        s = uuid4_str()
        u = uuid.UUID(s)
        assert (str(u), u.version, u.variant) == (s, 4, uuid.RFC_4122)
    assert len(new_attempt()) == 32


def test_tokens_do_not_repeat_across_blocks() -> None:
    tokens = [uuid4_hex() for _ in range(5000)]  # about 20 blocks of 256
    assert len(set(tokens)) == len(tokens)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_tokens() -> None:
    uuid4_hex()  # a block is read and partly used
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.write(write, ",".join(uuid4_hex() for _ in range(10)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode().split(",")
    os.close(read)
    os.waitpid(pid, 0)
    parent = [uuid4_hex() for _ in range(10)]
    assert not set(child) & set(parent)
