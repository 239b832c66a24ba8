"""Beat entry definitions: a schedule as JSON and back, the canonical stored JSON of an entry, and
the celery ``ScheduleEntry`` built from it (the format is in :mod:`celery_safe_time.beat.entries`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta, tzinfo
from json.encoder import encode_basestring_ascii
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_interval
from celery.schedules import solar
from dateutil.rrule import rrule as dateutil_rrule
from dateutil.rrule import rrulestr

from .. import constants as C
from ..clock import UTC
from ..exceptions import ScheduleError, SerializationError
from ..schedules import crontab, resolve_tz
from .slots import at, rrule

#: A crontab's fields, in the order its spec lists them.
_CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")


def _field(value: Any) -> str:
    """A crontab field as cron text (the JSON keeps what was written: ``"*/15"``, ``"1-5"``, ``"0"``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Iterable):
        return ",".join(str(v) for v in sorted(value))
    raise ScheduleError(f"crontab field {value!r} cannot be written as cron text")


def _tz_name(tz: tzinfo | str | None) -> str | None:
    if tz is None or isinstance(tz, str):
        return tz
    key = getattr(tz, "key", None)
    if isinstance(key, str):
        return key
    if tz is UTC or tz.utcoffset(None) == timedelta(0):
        return "UTC"
    raise ScheduleError(f"timezone {tz!r} has no IANA name; use a zoneinfo.ZoneInfo")


def schedule_to_spec(schedule: Any) -> dict[str, Any]:
    """The JSON form of a schedule: interval (number, timedelta, ``celery.schedules.schedule``),
    ``crontab`` (ours or celery's), ``solar``, ``rrule`` (dateutil's, redbeat's or ours), a
    datetime or :class:`at` (one-off), or an already written spec dict (validated)."""
    if isinstance(schedule, Mapping):
        spec = dict(schedule)
        schedule_from_spec(spec)  # validates
        return spec
    if isinstance(schedule, bool):
        raise ScheduleError(f"unsupported schedule {schedule!r}")
    if isinstance(schedule, (int, float)):
        return _interval(float(schedule))
    if isinstance(schedule, timedelta):
        return _interval(schedule.total_seconds())
    if isinstance(schedule, datetime):
        return schedule_to_spec(at(schedule))
    if isinstance(schedule, at):
        return {"type": "at", "at": schedule.when.isoformat()}
    if isinstance(schedule, celery_crontab):
        fields = {f: _field(getattr(schedule, f"_orig_{f}")) for f in _CRON_FIELDS}
        tz = schedule._tz_arg if isinstance(schedule, crontab) else None
        return {"type": "crontab", **fields, "tz": _tz_name(tz)}
    if isinstance(schedule, solar):
        return {"type": "solar", "event": schedule.event, "lat": schedule.lat, "lon": schedule.lon}
    if isinstance(schedule, celery_interval):
        return _interval(schedule.run_every.total_seconds())
    rule = schedule.rule if isinstance(schedule, rrule) else schedule
    rule = getattr(rule, "rrule", rule)  # redbeat.schedules.rrule wraps a dateutil rrule
    if isinstance(rule, dateutil_rrule):
        lines = [line for line in str(rule).splitlines() if line.startswith("RRULE:")]
        start: datetime = rule._dtstart
        tz = start.tzinfo
        name = getattr(tz, "key", None)
        return {
            "type": "rrule",
            "rule": lines[0][len("RRULE:") :] if lines else "",
            # a named zone keeps the wall time and its name (DST moves the instant); else the offset
            "dtstart": start.replace(tzinfo=None).isoformat() if name else start.isoformat(),
            "tz": name,
        }
    raise ScheduleError(f"unsupported schedule {schedule!r}")


def _interval(seconds: float) -> dict[str, Any]:
    if not math.isfinite(seconds) or seconds <= 0:
        raise ScheduleError(f"interval must be a positive number of seconds, got {seconds!r}")
    return {"type": "interval", "every": seconds}


def _aware(text: Any, what: str) -> datetime:
    if not isinstance(text, str):
        raise ScheduleError(f"{what}: expected an ISO 8601 string, got {text!r}")
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ScheduleError(f"{what}: {exc}") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def schedule_from_spec(spec: Any) -> Any:
    """The schedule object of a JSON spec; :class:`ScheduleError` naming the problem otherwise."""
    if not isinstance(spec, Mapping):
        raise ScheduleError(f"schedule spec must be an object, got {spec!r}")
    kind = spec.get("type")
    try:
        if kind == "interval":
            every = spec.get("every")
            if not isinstance(every, (int, float)) or isinstance(every, bool):
                raise ScheduleError(f"interval every: expected seconds, got {every!r}")
            return celery_interval(timedelta(seconds=_interval(float(every))["every"]))
        if kind == "crontab":
            fields = {f: spec.get(f, "*") for f in _CRON_FIELDS}
            return crontab(**fields, tz=spec.get("tz"))
        if kind == "solar":
            return solar(spec["event"], float(spec["lat"]), float(spec["lon"]))
        if kind == "at":
            return at(_aware(spec.get("at"), "at"))
        if kind == "rrule":
            tz = spec.get("tz")
            start = datetime.fromisoformat(str(spec["dtstart"]))
            if tz:
                start = start.replace(tzinfo=resolve_tz(tz, what="rrule tz"))
            made = rrulestr("RRULE:" + str(spec["rule"]), dtstart=start)
            if not isinstance(made, dateutil_rrule):
                raise ScheduleError(f"rrule {spec['rule']!r}: one RRULE expected")
            return rrule(made)
    except ScheduleError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ScheduleError(f"{kind} schedule {dict(spec)!r}: {exc.__class__.__name__}: {exc}") from None
    raise ScheduleError(f"unknown schedule type {kind!r} (interval, crontab, solar, rrule, at)")


# --- definitions --------------------------------------------------------------------------------


#: Values that come back from a JSON round trip as they went in (exact types: a subclass such as an
#: ``IntEnum`` may encode otherwise; a float may be NaN, which JSON has not).
_PLAIN = frozenset({str, int, bool, type(None)})


def _json(value: Any, what: str, name: str) -> Any:
    # Most entries' args, kwargs and options are flat lists and objects of plain values: they are
    # their own JSON round trip, and a bulk save would spend most of its time on the trip otherwise.
    if type(value) is list and all(type(v) in _PLAIN for v in value):
        return value
    if type(value) is dict and all(type(k) is str and type(v) in _PLAIN for k, v in value.items()):
        return value
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"entry {name!r}: {what} must be JSON-serialisable: {exc}") from None


#: The canonical JSON encoder of definitions, made once (``json.dumps`` with arguments builds one per call).
canonical_json = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False).encode


def definition_json(
    name: str,
    task: str,
    spec: dict[str, Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    options: Mapping[str, Any],
    enabled: bool,
    paused: Mapping[str, Any] | None = None,
) -> str:
    """The canonical JSON stored for an entry (sorted keys: an unchanged entry gives the same bytes).

    ``paused`` (a paused entry only): ``{"note": text or null, "until": ISO instant or null}``."""
    return definition_text(name, canonical_json(task), canonical_json(spec), args, kwargs, options, enabled, paused)


def definition_text(
    name: str, task_json: str, spec_json: str, args: Any, kwargs: Any, options: Any, enabled: bool, paused: Any = None
) -> str:
    """:func:`definition_json` from its parts, the task and schedule already encoded by
    :data:`canonical_json` (a bulk save encodes each distinct one once), the keys written in their
    sorted order. ``args``, ``kwargs`` and ``options`` are checked by a JSON round trip."""
    pause = ""
    if paused and not enabled:
        pause = ',"paused":' + canonical_json({"note": paused.get("note"), "until": paused.get("until")})
    return (
        '{"args":' + canonical_json(_json(list(args), "args", name))
        + ',"enabled":' + ("true" if enabled else "false")
        + ',"format":' + str(C.BEAT_ENTRY_FORMAT)
        + ',"kwargs":' + (canonical_json(_json(dict(kwargs), "kwargs", name)) if kwargs else "{}")
        + ',"name":' + encode_basestring_ascii(name)
        + ',"options":' + (canonical_json(_json(dict(options), "options", name)) if options else "{}")
        + pause + ',"schedule":' + spec_json + ',"task":' + task_json + "}"
    )  # fmt: skip


def parse_definition(raw: Any) -> dict[str, Any]:
    """A stored definition as a dict with every field present; :class:`ScheduleError` when broken."""
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ScheduleError(f"definition is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ScheduleError("definition must be a JSON object")
    if value.get("format", C.BEAT_ENTRY_FORMAT) != C.BEAT_ENTRY_FORMAT:
        raise ScheduleError(f"definition format {value.get('format')!r} is not {C.BEAT_ENTRY_FORMAT}")
    if not isinstance(value.get("task"), str) or not value["task"]:
        raise ScheduleError("definition has no task")
    args, kwargs, options = value.get("args") or [], value.get("kwargs") or {}, value.get("options") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(options, dict):
        raise ScheduleError("definition args must be a list, kwargs and options objects")
    paused = value.get("paused")
    if paused is not None:
        if not isinstance(paused, dict) or not isinstance(paused.get("note"), (str, type(None))):
            raise ScheduleError('definition "paused" must be an object with a text "note"')
        if paused.get("until") is not None:
            _aware(paused["until"], "paused until")
    return {
        "name": value.get("name"),
        "task": value["task"],
        "schedule": value.get("schedule"),
        "args": args,
        "kwargs": kwargs,
        "options": options,
        "enabled": bool(value.get("enabled", True)),
        "paused": paused,
    }


def paused_until(definition: Mapping[str, Any]) -> float | None:
    """When a parsed paused definition resumes by itself (UNIX seconds), None when it does not."""
    paused = definition.get("paused")
    if definition.get("enabled") or not paused or paused.get("until") is None:
        return None
    return _aware(paused["until"], "paused until").timestamp()


def spec_key(spec: Any) -> Any:
    """A hashable key of a schedule spec, for caches: specs are flat objects of strings and numbers,
    so a sorted item tuple is enough (``json.dumps`` per entry cost more than the rest of the load)."""
    if isinstance(spec, Mapping):
        try:
            key = tuple(sorted(spec.items()))
            hash(key)
            return key
        except TypeError:
            pass
    return json.dumps(spec, sort_keys=True, default=repr)


def cached_schedule(spec: Any, schedules: dict[Any, Any] | None) -> Any:
    """:func:`schedule_from_spec`, each distinct spec built once per ``schedules`` (None: no cache)."""
    if schedules is None:
        return schedule_from_spec(spec)
    key = spec_key(spec)
    schedule = schedules.get(key)
    if schedule is None:
        schedule = schedules[key] = schedule_from_spec(spec)
    return schedule


def build_entry(
    name: str, definition: Mapping[str, Any], app: Celery, schedules: dict[Any, Any] | None = None
) -> ScheduleEntry:
    """A celery ``ScheduleEntry`` for a parsed definition (raises :class:`ScheduleError`).

    ``schedules`` caches schedule objects by :func:`spec_key`: thousands of tenants share a handful
    of schedules ("09:00 in Europe/Berlin"), and building a crontab is the costly part of loading one.
    """
    schedule = cached_schedule(definition["schedule"], schedules)
    return ScheduleEntry(
        name=name,
        task=definition["task"],
        # the scheduler keeps the last run in its backend; passing one skips celery's app.now() per entry
        last_run_at=_NEVER_RAN,
        schedule=schedule,
        args=tuple(definition["args"]),
        kwargs=dict(definition["kwargs"]),
        options=dict(definition["options"]),
        app=app,
    )


#: ``last_run_at`` of a freshly built entry (the real last fired slot is in the backend's state).
_NEVER_RAN = datetime(1970, 1, 1, tzinfo=UTC)
