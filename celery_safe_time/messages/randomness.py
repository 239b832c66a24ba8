"""Random tokens for the per-message hot paths, from ``os.urandom`` read a few KiB at a time.

Every task message published by a process with this package gets a fresh attempt token
(:func:`celery_safe_time.messages.requeue.new_attempt`), and on Redis kombu draws a delivery tag per message:
each a ``uuid4``, one ``getrandom`` call. CPython releases the GIL around that call, so a thread
publishing thousands of messages a second hands the GIL over twice per message and waits to get it
back from whatever other thread runs (the sweep's claim thread: up to the switch interval each
time); the sweep's profile had ``os.urandom`` at about a tenth of its wall time. The bytes are the
same kernel randomness, read in blocks. A forked child starts with an empty block, so it never
repeats its parent's tokens.
"""

from __future__ import annotations

import os
import threading

#: Bytes read per ``os.urandom`` call: 256 tokens of 16 bytes.
_BLOCK = 4096

_lock = threading.Lock()
_buffer = b""
_offset = 0


def random_bytes16() -> bytes:
    """16 bytes from ``os.urandom``, never handed out twice (in this process or a forked child)."""
    global _buffer, _offset
    with _lock:
        if _offset + 16 > len(_buffer):
            _buffer, _offset = os.urandom(_BLOCK), 0
        start = _offset
        _offset = start + 16
        return _buffer[start : start + 16]


def _uuid4_bytes() -> bytearray:
    raw = bytearray(random_bytes16())
    # RFC 4122 version 4, variant 10xx: the bits uuid.UUID(version=4) sets.
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return raw


def uuid4_hex() -> str:
    """What ``uuid.uuid4().hex`` returns (32 hex digits, version 4)."""
    return _uuid4_bytes().hex()


def uuid4_str() -> str:
    """What ``str(uuid.uuid4())`` returns (the 8-4-4-4-12 form kombu uses for delivery tags)."""
    h = _uuid4_bytes().hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _forget_after_fork() -> None:
    global _buffer, _offset, _lock
    _lock = threading.Lock()
    _buffer, _offset = b"", 0


os.register_at_fork(after_in_child=_forget_after_fork)
