"""Batched publishing to RabbitMQ: a batch's ``basic.publish`` frames written in one socket write.

py-amqp writes (and, with ``connection.blocked``, reads the socket) once per publish and encodes each
header table item by item. :class:`BatchProducer` is a kombu ``Producer`` whose last step appends the
frames to a buffer, which :meth:`BatchProducer.flush` writes once; :class:`FrameEncoder` produces
py-amqp's bytes (tested against it) with a batch's repeated header items encoded once;
:class:`BatchSender` is ``send_task``'s per-row work with what a batch shares looked up once
(docs/benchmarks.md has the profile).
"""

from __future__ import annotations

import logging
from struct import pack
from typing import Any

import celery
from amqp.basic_message import Message
from amqp.channel import Channel as AmqpChannel
from amqp.serialization import _write_item, dumps
from celery.utils import uuid
from celery.utils.functional import maybe_list
from celery.utils.nodenames import anon_nodename
from dateutil.parser import isoparse
from kombu.common import maybe_declare
from kombu.messaging import Producer

from ..messages.compat import native_delayed_delivery, subtract_datetimes

logger = logging.getLogger(__name__)

#: basic.publish's class and method ids, and the content class (basic).
_BASIC_PUBLISH = pack(">HH", 60, 40)
_BASIC_CLASS = 60
_FRAME_END = b"\xce"
#: Basic's 14 properties fit one flag word (bits 15 down to 2), in this order.
_PROPERTY_ORDER = {name: order for order, (name, _kind) in enumerate(Message.PROPERTIES)}
_PROPERTY_KINDS = [kind for _name, kind in Message.PROPERTIES]
assert len(_PROPERTY_KINDS) <= 15, "more basic properties than one flag word holds"
#: Header items whose encoding an encoder keeps (a batch's distinct items stay far below).
_MEMO_ITEMS = 20_000


class FrameEncoder:
    """Encode ``basic.publish`` frames for one channel as py-amqp does, byte for byte.

    A header item ``(key, value)`` seen once is encoded once per encoder (one batch): a batch of one
    task repeats most of them. The memo holds the batch's items, so an encoder lives for one batch.
    """

    def __init__(self, channel_id: int, frame_max: int) -> None:
        self.channel_id = channel_id
        #: Largest frame payload (py-amqp's ``frame_max - 8``: header, size and end octet).
        self.chunk_size = frame_max - 8
        self._items: dict[tuple[str, type, Any], bytes] = {}
        self._keys: dict[str, bytes] = {}
        self._methods: dict[tuple[str, str, bool, bool], bytes] = {}

    def publish(
        self,
        body: bytes,
        properties: dict[str, Any],
        *,
        exchange: str,
        routing_key: str,
        mandatory: bool = False,
        immediate: bool = False,
    ) -> bytes:
        """The frames of one ``basic.publish`` of ``body`` with ``properties`` (py-amqp's names)."""
        channel = self.channel_id
        destination = (exchange, routing_key, mandatory, immediate)
        method = self._methods.get(destination)
        if method is None:  # the method frame is the same for every message to one destination
            args = b"".join(
                (
                    _BASIC_PUBLISH,
                    b"\x00\x00",  # reserved (ticket)
                    _shortstr(exchange),
                    _shortstr(routing_key),
                    pack("B", (1 if mandatory else 0) | (2 if immediate else 0)),
                )
            )
            method = self._methods[destination] = pack(">BHI", 1, channel, len(args)) + args + _FRAME_END
        header = pack(">HHQ", _BASIC_CLASS, 0, len(body)) + self.properties(properties)
        frames = [method, pack(">BHI", 2, channel, len(header)), header, _FRAME_END]
        chunk = self.chunk_size
        for start in range(0, len(body), chunk):
            part = body[start : start + chunk]
            frames += [pack(">BHI", 3, channel, len(part)), part, _FRAME_END]
        return b"".join(frames)

    def properties(self, properties: dict[str, Any]) -> bytes:
        """Basic content properties: the flag word, then the values present, in the spec's order."""
        present = sorted(
            (_PROPERTY_ORDER[k], v) for k, v in properties.items() if v is not None and k in _PROPERTY_ORDER
        )
        flag_bits = 0
        values: list[bytes] = []
        for order, value in present:
            flag_bits |= 1 << (15 - order)
            kind = _PROPERTY_KINDS[order]
            if kind == "s":
                values.append(_shortstr(value))
            elif kind == "o":
                values.append(pack("B", value))
            elif kind == "F":
                values.append(self.table(value))
            else:  # the rare ones (timestamp): py-amqp's own encoder
                values.append(dumps(kind, [value]))
        return pack(">H", flag_bits) + b"".join(values)

    def table(self, table: dict[str, Any]) -> bytes:
        """An AMQP field table; each item's encoding is reused for the rest of the batch.

        Strings that differ per message (the task id, the eta) are encoded here directly (the key's
        encoding kept); other values by py-amqp's own item encoder, once per distinct value.
        """
        items = self._items
        keys = self._keys
        parts: list[bytes] = []
        append = parts.append
        for key, value in table.items():
            kind = type(value)
            if kind is str:
                encoded = items.get((key, kind, value))
                if encoded is None:
                    prefix = keys.get(key)
                    if prefix is None:
                        prefix = keys[key] = _key(key) + b"S"
                    raw = value.encode("utf-8", "surrogatepass")
                    encoded = prefix + pack(">I", len(raw)) + raw
                    if len(items) < _MEMO_ITEMS:
                        items[(key, kind, value)] = encoded
                append(encoded)
                continue
            memo_key = _memo_key(key, value)
            if memo_key is None:  # tables and lists of tables: encoded each time
                append(_item(key, value))
                continue
            encoded = items.get(memo_key)
            if encoded is None:
                encoded = _item(key, value)
                if len(items) < _MEMO_ITEMS:
                    items[memo_key] = encoded
            append(encoded)
        data = b"".join(parts)
        return pack(">I", len(data)) + data


def _memo_key(key: str, value: Any) -> tuple[str, type, Any] | None:
    kind = type(value)
    if value is None or kind in (int, float, bool):
        return (key, kind, value)
    if kind in (list, tuple) and all(v is None or type(v) in (str, int, float, bool) for v in value):
        # a list of scalars (timelimit's [None, None]); the element types are part of the key (1 vs True)
        return (key, kind, tuple((type(v), v) for v in value))
    if kind is dict and not value:
        return (key, kind, ())
    return None


def _key(key: str) -> bytes:
    raw = key.encode("utf-8", "surrogatepass")
    return pack("B", len(raw)) + raw


def _shortstr(value: str | bytes) -> bytes:
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    if len(raw) > 255:
        raise ValueError(f"AMQP short string longer than 255 bytes: {raw[:40]!r}...")
    return pack("B", len(raw)) + raw


def _item(key: str, value: Any) -> bytes:
    raw_key = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else key
    out: list[bytes] = [pack("B", len(raw_key)), raw_key]
    _write_item(value, out.append, [])
    return b"".join(out)


def _frame_max(channel: Any) -> int:
    return int(getattr(getattr(channel, "connection", None), "frame_max", None) or 131072)


class BatchProducer(Producer):
    """A kombu producer on one py-amqp channel whose publishes are buffered until :meth:`flush`.

    ``on_publish`` is called once per message buffered (the sweep numbers its publisher confirms
    there: RabbitMQ numbers publishes in the order they reach it, the order of the buffer). Each
    entity a message must have declared (its queue, its exchange) is declared once per producer,
    with a round trip, before the first message that needs it.
    """

    def __init__(self, channel: Any, *, on_publish: Any, flush_bytes: int = 1 << 20, **kwargs: Any) -> None:
        super().__init__(channel, **kwargs)  # type: ignore[no-untyped-call]
        #: Only a py-amqp channel's frames are ours to write; another client (librabbitmq) publishes
        #: each message itself, as kombu does (numbered by the wrapper of its ``basic_publish``).
        self.buffering = isinstance(channel, AmqpChannel)
        self._encoder = FrameEncoder(getattr(channel, "channel_id", 1), _frame_max(channel))
        self._on_publish = on_publish
        self._flush_bytes = flush_bytes
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._declared: dict[int, Any] = {}

    def _publish(
        self,
        body: bytes | str,
        priority: int | None,
        content_type: str | None,
        content_encoding: str | None,
        headers: dict[str, Any] | None,
        properties: dict[str, Any],
        routing_key: str,
        mandatory: bool,
        immediate: bool,
        exchange: str,
        declare: list[Any] | None,
        timeout: float | None = None,
        confirm_timeout: float | None = None,
        retry: bool = False,
        retry_policy: dict[str, Any] | None = None,
    ) -> Any:
        if not self.buffering:
            return super()._publish(  # type: ignore[no-untyped-call]
                body, priority, content_type, content_encoding, headers, properties, routing_key, mandatory,
                immediate, exchange, declare, timeout, confirm_timeout, retry, retry_policy,
            )  # fmt: skip
        # What kombu's Producer._publish and py-amqp's basic_publish do, minus the write.
        for entity in declare or ():
            if entity and id(entity) not in self._declared:
                self.flush()  # the declare's round trip must not overtake what is buffered
                maybe_declare(entity, self.channel, retry, **(retry_policy or {}))  # type: ignore[no-untyped-call]
                self._declared[id(entity)] = entity  # the object kept, so its id is not reused
        if isinstance(body, str):
            content_encoding = content_encoding or "utf-8"
            body = body.encode(content_encoding)
        props = {
            "priority": priority,
            "content_type": content_type,
            "content_encoding": content_encoding,
            "application_headers": headers,
            **properties,
        }
        reply_to = props.get("reply_to")
        if reply_to is not None and not isinstance(reply_to, str):
            props["reply_to"] = reply_to.name  # a kombu Queue: its (generated) name
        frames = self._encoder.publish(
            body, props, exchange=exchange, routing_key=routing_key, mandatory=mandatory, immediate=immediate
        )
        self._on_publish()
        self._buffer.append(frames)
        self._buffered += len(frames)
        if self._buffered >= self._flush_bytes:
            self.flush()

    def new_batch(self) -> None:
        """Start a new batch: the header items kept for the last one are dropped (memory stays per batch)."""
        self._encoder = FrameEncoder(self._encoder.channel_id, _frame_max(self.channel))

    def flush(self) -> None:
        """Write what is buffered in one socket write (a connection error propagates)."""
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer.clear()
        self._buffered = 0
        connection = self.channel.connection
        connection.transport.write(data)
        connection.bytes_sent += 1  # what py-amqp's frame writer counts: heartbeats see traffic went out


#: The Celery release whose ``send_task`` :meth:`BatchSender.send_task` follows, argument for argument.
MIRRORED_CELERY = (5, 7)


#: The values :func:`plain_repr` renders itself (``bool`` and ``None`` included: exact types, no subclasses).
_PLAIN_SCALARS = (int, float, bool, type(None))


def plain_repr(value: Any, maxsize: int) -> str | None:
    """``repr(value)`` when it is what Celery's ``saferepr(value, maxsize)`` returns, else None.

    ``saferepr`` (Celery's ``argsrepr``/``kwargsrepr`` headers, what monitoring shows of a task's
    arguments) walks the value item by item: about 70 us a message, the largest single cost of
    Celery's message build. For the common case it equals ``repr``: a list, tuple or dict (string
    keys) of numbers, booleans, None and short printable ASCII strings without quotes or
    backslashes (``saferepr`` quotes and escapes those differently), one level deep, well under
    ``maxsize`` (so nothing is truncated). Anything else returns None and gets ``saferepr`` itself.
    """
    kind = type(value)
    if kind is dict:
        items: Any = value.items()
        if not all(type(k) is str and _plain_str(k) and _plain(v) for k, v in items):
            return None
    elif kind is list or kind is tuple:
        if not all(_plain(v) for v in value):
            return None
    else:
        return None
    text = repr(value)
    return text if len(text) <= maxsize // 2 else None


def _plain(value: Any) -> bool:
    kind = type(value)
    return kind in _PLAIN_SCALARS or (kind is str and _plain_str(value))


def _plain_str(text: str) -> bool:
    return text.isascii() and text.isprintable() and "'" not in text and '"' not in text and "\\" not in text


class BatchSender:
    """Celery's ``send_task`` for the rows of one batch, with what is the same for every row looked up once.

    The message, its routing and the publish signals are Celery's own, per row. Left out, as a sweeper
    never reads its rows' results: the ``AsyncResult``, ``backend.on_task_call`` (a SUBSCRIBE per row on
    a Redis result backend) and ``add_to_parent``. On quorum queues with native delayed delivery, and on
    a Celery other than :data:`MIRRORED_CELERY` (whose ``send_task`` this follows), rows go through
    ``app.send_task`` itself, into the same buffer and under the same confirms.
    """

    def __init__(self, app: Any, producer: Any) -> None:
        self.app = app
        self.producer = producer
        conf = app.conf
        self._send_event = conf.task_send_sent_event
        self._inherit_priority = conf.task_inherit_parent_priority
        self._reply_to = app.thread_oid
        self._parent = app.current_worker_task
        self._router = app.amqp.router
        self._exec_options: dict[str, dict[str, Any]] = {}
        #: What as_task_v2 would look up per message (the host's node name, the repr limits).
        self._origin = anon_nodename()
        self._argsrepr_max = app.amqp.argsrepr_maxsize
        self._kwargsrepr_max = app.amqp.kwargsrepr_maxsize
        #: Celery's own ``send_task`` per row: on another Celery than the one mirrored here, and on
        #: quorum queues (native delayed delivery reroutes messages with an eta).
        driver_type = producer.connection.transport.driver_type
        self.via_send_task = celery.VERSION[:2] != MIRRORED_CELERY or native_delayed_delivery(app, driver_type)

    def _task_options(self, name: str) -> tuple[Any, dict[str, Any]]:
        task = self.app.tasks.get(name)
        options = self._exec_options.get(name)
        if options is None:
            raw = task._get_exec_options() if task is not None and hasattr(task, "_get_exec_options") else None
            options = self._exec_options[name] = {k: v for k, v in (raw or {}).items() if v is not None}
        return task, options

    def send_task(self, name: str, args: Any, kwargs: Any, *, expires: Any, **options: Any) -> None:
        """``app.send_task(name, args, kwargs, expires=expires, **options)`` (Celery 5.7), the message
        published through this batch's producer (a ``producer=`` given is not used)."""
        app = self.app
        options.pop("producer", None)
        if self.via_send_task:
            app.send_task(name, args, kwargs, expires=expires, producer=self.producer, **options)
            return
        # send_task's named arguments; the rest are the message's options.
        pop = options.pop
        task_id, task_type = pop("task_id", None) or uuid(), pop("task_type", None)
        countdown, eta, retries, chord = pop("countdown", None), pop("eta", None), pop("retries", 0), pop("chord", None)
        link, link_error, reply_to = pop("link", None), pop("link_error", None), pop("reply_to", None)
        group_id, group_index, route_name = pop("group_id", None), pop("group_index", None), pop("route_name", None)
        root_id, parent_id, shadow = pop("root_id", None), pop("parent_id", None), pop("shadow", None)
        chain, nesting = pop("chain", None), pop("replaced_task_nesting", 0)
        pop("add_to_parent", None)
        task, defaults = self._task_options(name) if task_type is None else (task_type, {})
        if defaults:
            options = dict(defaults, **options)
        # As send_task: create_task_message's own arguments, not message properties (a task's default
        # time limits unless the call set its own; ``expires`` is always the call's).
        time_limit, soft_time_limit = options.pop("time_limit", None), options.pop("soft_time_limit", None)
        options.pop("expires", None)
        ignore_result = options.pop("ignore_result", None)
        options = self._router.route(options, route_name or name, args, kwargs, task)
        if expires is not None:
            if isinstance(expires, (int, float)):
                seconds = expires
            else:
                at = isoparse(expires) if isinstance(expires, str) else expires
                seconds = subtract_datetimes(at, app.now()).total_seconds()
            options["expiration"] = max(0, seconds)  # past: expire on arrival unless consumed (as send_task)
        # For the message only (send_task_message would pass them on as message properties).
        build: dict[str, Any] = {"origin": self._origin} if "origin" not in options else {}
        # One level deep, so saferepr's depth limit (task_repr_maxlevels) never applies to these.
        if "argsrepr" not in options:
            build["argsrepr"] = plain_repr(args or (), self._argsrepr_max)
        if "kwargsrepr" not in options:
            build["kwargsrepr"] = plain_repr(kwargs or {}, self._kwargsrepr_max)
        parent = self._parent
        if parent and (not root_id or not parent_id):
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
            if self._inherit_priority:
                options.setdefault("priority", parent.request.delivery_info.get("priority"))
        message = app.amqp.create_task_message(
            task_id, name, args, kwargs, countdown, eta, group_id, group_index, expires, retries, chord,
            maybe_list(link), maybe_list(link_error), reply_to or self._reply_to, time_limit, soft_time_limit,
            self._send_event, root_id, parent_id, shadow, chain,
            ignore_result=ignore_result, replaced_task_nesting=nesting, **build, **options,
        )  # fmt: skip
        for stamp in options.pop("stamped_headers", []):
            options.pop(stamp)
        with self.producer.connection._reraise_as_library_errors():
            app.amqp.send_task_message(self.producer, name, message, **options)
