"""``celery safe-time beat import-redbeat``: copy celery-redbeat's entries, and their last run, into
runtime entries.

celery-redbeat keeps one hash per entry at ``<prefix><name>`` with a ``definition`` field (JSON with
``__type__`` objects: ``interval``, ``crontab``, ``rrule``, ``weekday``, ``datetime``) and a ``meta``
field (``last_run_at``), and a sorted set ``<prefix>:schedule`` of those keys. This module reads
that layout itself (redbeat need not be installed) and never writes redbeat's keys.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from dateutil.rrule import rrule as dateutil_rrule
from dateutil.rrule import weekday

from .. import constants as C
from ..config import first_broker_url, mask_url
from ..exceptions import ImproperlyConfigured, SafeTimeError, ScheduleError
from ..redis_client import as_text, get_redis
from ..schedules import resolve_tz
from .entries import _Store, build_entry, get_entry, parse_definition, save_entry, schedule_to_spec
from .slots import NEVER, at, entry_plan
from .state import dump_state

logger = logging.getLogger(__name__)

__all__ = ["ImportResult", "decode_redbeat", "import_redbeat"]


@dataclasses.dataclass
class ImportResult:
    #: The key prefix and the (masked) Redis URL the entries were read from.
    prefix: str = ""
    redis_url: str = ""
    imported: list[str] = dataclasses.field(default_factory=list)
    unchanged: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> error

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _object(d: dict[str, Any]) -> Any:
    """redbeat's ``RedBeatJSONDecoder`` object hook, without importing redbeat."""
    kind = d.pop("__type__", None)
    if kind is None:
        return d
    if kind == "datetime":
        zone = d.pop("timezone", "UTC")
        if isinstance(zone, (int, float)):  # an offset in seconds
            tz: Any = timezone(timedelta(seconds=zone))
        else:
            tz = resolve_tz(zone, what="redbeat datetime timezone")
        return datetime(tzinfo=tz, **d)
    if kind == "interval":
        return timedelta(seconds=float(d["every"]))
    if kind == "crontab":
        return {"type": "crontab", "tz": None, **{k: str(v) for k, v in d.items()}}
    if kind == "weekday":
        return weekday(int(d["wkday"]))
    if kind == "rrule":
        for key, tz_key in (("dtstart", "dtstart_tz"), ("until", "until_tz")):
            minutes = d.pop(tz_key, 0) or 0
            if d.get(key) is not None:
                d[key] = datetime.fromtimestamp(d[key], timezone(timedelta(minutes=minutes)))
        freq = d.pop("freq")
        return dateutil_rrule(freq, **{k: v for k, v in d.items() if v is not None})
    raise ScheduleError(f"unknown redbeat type {kind!r}")


def decode_redbeat(raw: Any) -> Any:
    return json.loads(raw, object_hook=_object)


def _prefix(prefix: str) -> str:
    # redbeat's default redbeat_key_prefix is "redbeat:"; "--prefix redbeat" means that one
    return prefix if prefix.endswith(":") else prefix + ":"


def redbeat_location(app: Celery, prefix: str | None = None, redis_url: str | None = None) -> tuple[str, str]:
    """``(key prefix, Redis URL)`` of redbeat's entries, found as redbeat finds them: ``prefix``, else
    ``redbeat_key_prefix``, else ``redbeat:``; ``redis_url``, else ``redbeat_redis_url``, else the broker."""
    key_prefix = _prefix(prefix) if prefix else str(app.conf.get("redbeat_key_prefix") or C.REDBEAT_KEY_PREFIX)
    if redis_url:
        return key_prefix, redis_url
    url = app.conf.get("redbeat_redis_url")
    if url:
        return key_prefix, str(url)
    broker = first_broker_url(app)
    if urlsplit(broker).scheme.lower() not in C.REDIS_URL_SCHEMES:
        raise ImproperlyConfigured(
            "redbeat_redis_url",
            f"is unset and the broker ({mask_url(broker) or 'none'}) is not Redis: pass --redis-url with the "
            "Redis that holds redbeat's entries",
        )
    return key_prefix, broker


def import_redbeat(
    app: Celery, prefix: str | None = None, *, dry_run: bool = False, redis_url: str | None = None
) -> ImportResult:
    """Copy every redbeat entry under ``prefix`` into a runtime entry with the same name, task,
    schedule, arguments, options and enabled flag; its ``last_run_at`` becomes the entry's last
    fired slot, so the leader continues after it (a slot missed meanwhile follows the misfire
    policy). Idempotent: importing again changes nothing. Config entries keep their own.

    The entries are read where redbeat keeps them (:func:`redbeat_location`), which need not be
    ``safe_time_redis_url``; they are written wherever this app's runtime entries live."""
    store = _Store(app)
    key_prefix, url = redbeat_location(app, prefix, redis_url)
    client = get_redis(url)
    keys = [as_text(k) for k in client.zrange(key_prefix + ":schedule", 0, -1)]
    result = ImportResult(prefix=key_prefix, redis_url=mask_url(url))
    config = store.config_entries()
    for key in keys:
        name = key[len(key_prefix) :] if key.startswith(key_prefix) else key
        definition_raw, meta_raw = client.hmget(key, ["definition", "meta"])
        if definition_raw is None:
            result.skipped[name] = "no definition (deleted in redbeat)"
            continue
        if name in config:
            result.skipped[name] = "a beat_schedule entry of this app has that name"
            continue
        try:
            d = decode_redbeat(definition_raw)
            meta = decode_redbeat(meta_raw) if meta_raw else {}
            schedule = d["schedule"]
            last = meta.get("last_run_at")
            if isinstance(last, datetime) and last.year <= 1:
                last = None  # redbeat's "never ran" marker
            options = dict(d.get("options") or {})
            args, kwargs, enabled = d.get("args") or [], d.get("kwargs") or {}, bool(d.get("enabled", True))
            if dry_run:
                schedule_to_spec(schedule)
                result.imported.append(name)
                continue
            before = get_entry(name, app=store.app)
            if isinstance(last, datetime):
                _seed_state(store, name, d["task"], schedule, args, kwargs, options, last)
            info = save_entry(
                name, d["task"], schedule, args=args, kwargs=kwargs, options=options, enabled=enabled,
                app=store.app,
            )  # fmt: skip
            if before is not None and before.version == info.version:
                result.unchanged.append(name)
            else:
                result.imported.append(name)
        except (SafeTimeError, KeyError, TypeError, ValueError) as exc:
            result.failed[name] = f"{exc.__class__.__name__}: {exc}"
            logger.warning("import-redbeat: entry %r not imported: %s", name, exc)
    return result


def _seed_state(
    store: _Store, name: str, task: str, schedule: Any, args: Any, kwargs: Any, options: Any, last: datetime
) -> None:
    """Write the state a leader would have after firing ``last``, unless the entry has state already.

    Only new entries get it (HSETNX on Redis), before their definition exists, so no leader plans them yet:
    the leader then takes the definition with this state and continues the grid after ``last``.
    """
    spec = schedule_to_spec(schedule)
    definition = {"task": task, "schedule": spec, "args": list(args), "kwargs": dict(kwargs)}
    entry = build_entry(name, parse_definition(json.dumps({**definition, "options": dict(options)})), store.app)
    grid = entry_plan(entry, store.config, store.app).grid
    ts = last.timestamp()
    next_fire = grid.next(ts)
    if isinstance(entry.schedule, at) or next_fire == NEVER:
        next_fire = NEVER
    store.backend.entry_seed_state(name, dump_state(ts, next_fire, grid.signature()))
