"""Change audit of django-celery-beat's rows, read with :func:`celery_safe_time.entry_audit` and on the
admin's entry page (what is and is not audited: docs/beat.md).

Connected by the app's ``ready()`` when ``django_celery_beat`` is installed: ``pre_save`` /
``pre_delete`` of ``PeriodicTask`` read the stored definition, ``post_save`` / ``post_delete`` compare
and append a record once the transaction commits; a save that changes no definition field (beat's
``last_run_at`` after each run) writes nothing. The admin's enable/disable actions are queryset
``update()`` calls, which send no signal: they are wrapped to compare the rows before and after.
An audit write never fails the save: an error is logged as a warning and dropped.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ...beat import history
from ...beat.state import with_definitions
from .rows import row_definition

logger = logging.getLogger(__name__)

#: Who the changes made in this context are by (set around the PeriodicTask admin's views).
_changed_by: contextvars.ContextVar[str | None] = contextvars.ContextVar("safe_time_dcb_changed_by", default=None)

#: Set while a wrapped bulk action runs: an override calling the wrapped one records once.
_in_bulk: contextvars.ContextVar[bool] = contextvars.ContextVar("safe_time_dcb_in_bulk", default=False)

#: Where pre_save / pre_delete leave the row's stored (name, definition) for the post_ signal.
_BEFORE = "_safe_time_audit_before"

#: Fields of ``PeriodicTask`` that are not part of its definition: a save writing only these (the
#: scheduler after a run) is no change.
_BOOKKEEPING = frozenset({"last_run_at", "total_run_count", "date_changed"})

#: django-celery-beat's admin actions that change rows with a queryset ``update()`` (no signals).
BULK_ACTIONS = ("enable_tasks", "disable_tasks", "toggle_tasks")

#: A ``PeriodicTask``'s schedule relations, read with it (its definition shows its schedule).
_SCHEDULES = ("interval", "crontab", "solar", "clocked")

#: The PeriodicTask admin views a change goes through (actions run inside the changelist view).
_ADMIN_VIEWS = ("changeform_view", "changelist_view", "delete_view")


# --- definitions --------------------------------------------------------------------------------


def change_action(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str | None:
    """The audit action between two definitions; None when nothing but bookkeeping changed.

    Only the ``enabled`` flag differing is ``enable`` / ``disable``; anything else is ``update``."""
    if old is None and new is None:
        return None
    if old is None:
        return "create"
    if new is None:
        return "delete"
    if dict(old) == dict(new):
        return None
    rest_old = {k: v for k, v in old.items() if k != "enabled"}
    rest_new = {k: v for k, v in new.items() if k != "enabled"}
    if rest_old == rest_new:
        return "enable" if new.get("enabled") else "disable"
    return "update"


# --- writing ------------------------------------------------------------------------------------


def changed_by() -> str | None:
    """Who the current change is by: the admin user inside the PeriodicTask admin, else None (the
    package's default ``user@host pid N``)."""
    return _changed_by.get()


@contextmanager
def changes_by(who: str | None) -> Iterator[None]:
    """Record the changes made inside as by ``who``."""
    token = _changed_by.set(who)
    try:
        yield
    finally:
        _changed_by.reset(token)


def _write(
    name: str, action: str, who: str | None, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None
) -> None:
    """Append one record to ``name``'s audit; never raises (the change is made already)."""
    try:
        from .overview import celery_app

        backend = history.cached_backend(celery_app())
        meta = history.audit_meta(backend.config, action, who, backend.clock.time())
        if meta is None:
            return
        dump = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"), default=str)
        record = with_definitions(meta, None if old is None else dump(old), None if new is None else dump(new), None)
        backend.audit_append(name, record)
    except Exception as exc:
        logger.warning("beat: the change audit of django-celery-beat entry %r could not be written: %s", name, exc)


def record_change(
    name: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None, using: str | None = None
) -> None:
    """Append the record of ``old`` -> ``new`` (when they differ) to ``name``'s audit once the current
    transaction on ``using`` commits (at once outside a transaction)."""
    from django.db import transaction

    action = change_action(old, new)
    if action is None:
        return
    who = changed_by()  # read now: the commit may run outside the admin view's context
    transaction.on_commit(lambda: _write(name, action, who, old, new), using=using)


def _stored(sender: Any, pk: Any, using: str | None) -> tuple[str, dict[str, Any]] | None:
    row = sender._default_manager.using(using).select_related(*_SCHEDULES).filter(pk=pk).first()
    return None if row is None else (row.name, row_definition(row))


def on_pre_save(sender: Any, instance: Any, raw: bool = False, using: str | None = None, **kwargs: Any) -> None:
    setattr(instance, _BEFORE, None)
    update_fields = kwargs.get("update_fields")
    if raw or (update_fields is not None and set(update_fields) <= _BOOKKEEPING):
        setattr(instance, _BEFORE, False)  # no audit for this save
        return
    try:
        if instance.pk is not None:
            setattr(instance, _BEFORE, _stored(sender, instance.pk, using))
    except Exception as exc:
        setattr(instance, _BEFORE, False)
        logger.warning(
            "beat: the change audit of django-celery-beat entry %r could not be read: %s", instance.name, exc
        )


def on_post_save(sender: Any, instance: Any, raw: bool = False, using: str | None = None, **_: Any) -> None:
    before = instance.__dict__.pop(_BEFORE, None)
    if before is False:
        return
    try:
        old = before[1] if before else None
        record_change(instance.name, old, row_definition(instance), using)
    except Exception as exc:
        logger.warning("beat: the change audit of django-celery-beat entry %r failed: %s", instance.name, exc)


def on_pre_delete(sender: Any, instance: Any, using: str | None = None, **_: Any) -> None:
    # read before the delete: a cascade from a schedule row removes the schedule the definition shows
    try:
        setattr(instance, _BEFORE, (instance.name, row_definition(instance)))
    except Exception as exc:
        setattr(instance, _BEFORE, None)
        logger.warning(
            "beat: the change audit of django-celery-beat entry %r could not be read: %s", instance.name, exc
        )


def on_post_delete(sender: Any, instance: Any, using: str | None = None, **_: Any) -> None:
    before = instance.__dict__.pop(_BEFORE, None)
    try:
        name, old = before if before else (instance.name, {"name": instance.name})
        record_change(name, old, None, using)
    except Exception as exc:
        logger.warning("beat: the change audit of django-celery-beat entry %r failed: %s", instance.name, exc)


# --- the admin ----------------------------------------------------------------------------------


def admin_user(request: Any) -> str | None:
    """``"alice (django admin)"`` for a request by a logged-in user, else None."""
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    return f"{user.get_username()} (django admin)"


def _view(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def view(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        with changes_by(admin_user(request)):
            return method(self, request, *args, **kwargs)

    return view


def _bulk(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an admin action that changes rows with ``queryset.update()``: the rows' definitions
    before and after are compared, and each changed row gets its record."""

    @functools.wraps(method)  # keeps the action's description and permissions
    def action(self: Any, request: Any, queryset: Any) -> Any:
        if _in_bulk.get():  # a subclass's override calling this one: the outer call records
            return method(self, request, queryset)
        token = _in_bulk.set(True)
        try:
            return _audited(method, self, request, queryset)
        finally:
            _in_bulk.reset(token)

    return action


def _audited(method: Callable[..., Any], admin: Any, request: Any, queryset: Any) -> Any:
    """Run the action, then record each row whose definition it changed."""
    try:
        before = {row.pk: row_definition(row) for row in queryset.select_related(*_SCHEDULES)}
    except Exception as exc:
        logger.warning("beat: the change audit of a django-celery-beat admin action could not be read: %s", exc)
        before = None
    result = method(admin, request, queryset)
    if before:
        try:
            with changes_by(admin_user(request)):
                using = queryset.db
                rows = queryset.model._default_manager.using(using).select_related(*_SCHEDULES)
                for row in rows.filter(pk__in=list(before)):
                    record_change(row.name, before[row.pk], row_definition(row), using)
        except Exception as exc:
            logger.warning("beat: the change audit of a django-celery-beat admin action failed: %s", exc)
    return result


def audit_admin(admin_class: type) -> None:
    """Make ``admin_class`` (a ``PeriodicTask`` ModelAdmin) record who its changes are by, and audit
    its bulk actions. Idempotent; a subclass of a wrapped class is covered already.

    Wrapping the admin's views (not ``save_model`` / ``delete_model``) covers the change form, the
    delete page and every action (``delete_selected`` included) with one context each, and needs no
    middleware in the project's settings; django-celery-beat's admin stays as it is, unforked."""
    if admin_class.__dict__.get("_safe_time_audited"):
        return
    for names, wrap in ((_ADMIN_VIEWS, _view), (BULK_ACTIONS, _bulk)):
        for name in names:
            method = getattr(admin_class, name, None)
            if method is not None and not getattr(method, "_safe_time_audited", False):
                wrapped = wrap(method)
                wrapped._safe_time_audited = True  # type: ignore[attr-defined]
                setattr(admin_class, name, wrapped)
    admin_class._safe_time_audited = True  # type: ignore[attr-defined]


def connect() -> None:
    """Connect the ``PeriodicTask`` signals and wrap its admin (the app's ``ready()`` calls this when
    ``django_celery_beat`` is installed)."""
    from django.apps import apps
    from django.db.models import signals
    from django_celery_beat.models import PeriodicTask

    uid = "celery_safe_time.dcb_audit"
    signals.pre_save.connect(on_pre_save, sender=PeriodicTask, dispatch_uid=uid)
    signals.post_save.connect(on_post_save, sender=PeriodicTask, dispatch_uid=uid)
    signals.pre_delete.connect(on_pre_delete, sender=PeriodicTask, dispatch_uid=uid)
    signals.post_delete.connect(on_post_delete, sender=PeriodicTask, dispatch_uid=uid)
    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib import admin
    from django_celery_beat.admin import PeriodicTaskAdmin

    audit_admin(PeriodicTaskAdmin)
    # A project may register its own admin for PeriodicTask instead (registered before this app's
    # ready() when django.contrib.admin comes first in INSTALLED_APPS, as usual).
    registered = admin.site._registry.get(PeriodicTask)
    if registered is not None:
        audit_admin(type(registered))
