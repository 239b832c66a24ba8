"""Admin for stored delayed tasks, and the "Safe time" overview page.

The changelist shows which call a row is (its decoded arguments; a pickled payload is never
decoded here) and its delivery record; filters by status, outcome, task and due time; search by
id and idempotency key; cancel, reschedule and rerun actions, each behind a confirmation page. The
detail page is read-only: rows come from ``SafeTask.apply_async`` and change through the store.
The overview (``overview/``, linked from the changelist and the app index) is
``celery safe-time status`` as a page (see ``overview.py``).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, cast

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, re_path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from ... import constants as C
from ... import signals
from ...clock import UTC, as_utc
from ...exceptions import SafeTimeError, SerializationError
from .chart import due_chart_svg
from .models import DelayedTask
from .store import DjangoStore

#: django-celery-beat's permission to see its periodic tasks; beat entry pages need it too.
DCB_VIEW_PERMISSION = "django_celery_beat.view_periodictask"

#: The changelist's arguments column is cut to this many characters (the detail page shows all).
ARGUMENTS_LIST_CHARS = 80

PICKLE_NOT_DECODED = "(pickle, not decoded)"

#: A confirmation page lists at most this many of the selected rows (and says how many more).
CONFIRM_LIST_ROWS = 100


def decoded_call(obj: DelayedTask) -> dict[str, Any] | str:
    """The stored call's ``{"args", "kwargs", ...}``, or a short text saying why it is not shown.

    Pickle is refused whatever ``safe_time_allow_pickle`` says: loading one runs code chosen by
    whoever wrote the row, and an admin page is no place for that.
    """
    from ...delays.payload import decode, is_pickle

    if is_pickle(obj.content_type or ""):
        return PICKLE_NOT_DECODED
    try:
        return decode(bytes(obj.payload or b""), obj.content_type, obj.content_encoding, allow_pickle=False)
    except SerializationError as exc:
        return f"(not decoded: {exc})"


def arguments_text(obj: DelayedTask, limit: int | None = None) -> str:
    call = decoded_call(obj)
    if isinstance(call, str):
        return call
    parts = [json.dumps(arg, default=repr, ensure_ascii=False) for arg in call.get("args") or ()]
    parts += [
        f"{key}={json.dumps(value, default=repr, ensure_ascii=False)}"
        for key, value in (call.get("kwargs") or {}).items()
    ]
    text = ", ".join(parts)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return text


class DueFilter(admin.SimpleListFilter):
    """Due time relative to now: overdue, within an hour, a day, two days, a week, later."""

    title = "due"
    parameter_name = "due"
    WINDOWS: dict[str, tuple[str, timedelta | None]] = {
        "overdue": ("overdue", None),
        "1h": ("in the next hour", timedelta(hours=1)),
        "24h": ("in the next 24 hours", timedelta(hours=24)),
        "48h": ("in the next 48 hours", timedelta(hours=48)),
        "7d": ("in the next 7 days", timedelta(days=7)),
        "later": ("later than 7 days", timedelta(days=7)),
    }

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [(key, label) for key, (label, _) in self.WINDOWS.items()]

    def queryset(self, request: Any, queryset: Any) -> Any:
        choice = self.value()
        if choice not in self.WINDOWS:
            return queryset
        now = DjangoStore(using=queryset.db).now()
        window = self.WINDOWS[choice][1]
        if choice == "overdue":
            return queryset.filter(due_at__lt=now)
        assert window is not None
        if choice == "later":
            return queryset.filter(due_at__gte=now + window)
        return queryset.filter(due_at__gte=now, due_at__lt=now + window)


class RescheduleForm(forms.Form):
    due_at = forms.DateTimeField(
        label="New due time (UTC)",
        input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S"],
        widget=forms.DateTimeInput(attrs={"type": "datetime-local", "step": "1"}, format="%Y-%m-%dT%H:%M:%S"),
    )


@admin.register(DelayedTask)
class DelayedTaskAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "task",
        "status",
        "due_at",
        "arguments",
        "debounce",
        "outcome",
        "started_at",
        "finished_at",
        "worker",
        "starts",
        "attempts",
        "last_error",
    )
    list_filter = ("status", DueFilter, "outcome", "task")
    search_fields = ("id", "idempotency_key")
    ordering = ("due_at", "id")
    date_hierarchy = "due_at"
    exclude = ("payload",)
    readonly_fields = (
        "id",
        "task",
        "call",
        "payload_size",
        "content_type",
        "content_encoding",
        "due_at",
        "expires_at",
        "status",
        "idempotency_key",
        "attempts",
        "created_at",
        "updated_at",
        "claimed_at",
        "claim_token",
        "sent_at",
        "last_error",
        "delivery_token",
        "started_at",
        "heartbeat_at",
        "finished_at",
        "outcome",
        "worker",
        "started_by",
        "starts",
        "suspected_at",
        "debounce",
        "debounce_until",
    )
    actions = ["cancel_pending", "reschedule_pending", "rerun_failed"]

    def has_add_permission(self, request: Any) -> bool:
        # Rows come from SafeTask.apply_async; a hand-made payload would be a corrupt call.
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        # The changelist's actions need it; one row's page is read-only (it changes through the store).
        return obj is None and bool(super().has_change_permission(request, obj))

    @admin.display(description="arguments")
    def arguments(self, obj: DelayedTask) -> str:
        return arguments_text(obj, ARGUMENTS_LIST_CHARS)

    @admin.display(description="debounce key")
    def debounce(self, obj: DelayedTask) -> str:
        # A debounced row keeps its key in the pending-only unique key, behind a prefix.
        key = obj.idempotency_key or ""
        return key[len(C.DEBOUNCE_KEY_PREFIX) :] if key.startswith(C.DEBOUNCE_KEY_PREFIX) else "-"

    @admin.display(description="call (decoded payload)")
    def call(self, obj: DelayedTask) -> str:
        decoded = decoded_call(obj)
        if isinstance(decoded, str):
            return decoded
        pretty = json.dumps(decoded, indent=2, default=repr, ensure_ascii=False)
        return cast(str, format_html("<pre>{}</pre>", pretty))  # a SafeString: the <pre> is not escaped

    @admin.display(description="payload bytes")
    def payload_size(self, obj: DelayedTask) -> int:
        return len(bytes(obj.payload or b""))

    # --- actions, each behind a confirmation page ----------------------------------------

    def _confirm(
        self,
        request: Any,
        queryset: Any,
        action: str,
        title: str,
        form: forms.Form | None = None,
        changes: frozenset[str] = C.DELAY_CANCELLABLE_STATUSES,
    ) -> TemplateResponse:
        # "Select all N" hands the whole filtered table here: list the first rows, carry the choice on.
        select_across = request.POST.get("select_across") == "1"
        rows = list(queryset.order_by("due_at", "id")[: CONFIRM_LIST_ROWS + 1])
        total = queryset.count() if len(rows) > CONFIRM_LIST_ROWS else len(rows)
        rows = rows[:CONFIRM_LIST_ROWS]
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "action": action,
            "rows": [(row, arguments_text(row, ARGUMENTS_LIST_CHARS)) for row in rows],
            # posted back as they came: Django runs a confirmed action only when some ids come with it
            "selected_ids": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME),
            "select_across": select_across,
            "total": total,
            "more": total - len(rows),
            "unchanged": [row for row in rows if row.status not in changes],
            "form": form,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/celery_safe_time/delayedtask/confirm_action.html", context)

    @admin.action(description="Cancel selected delayed tasks that have not started", permissions=["change"])
    def cancel_pending(self, request: Any, queryset: Any) -> TemplateResponse | None:
        if request.POST.get("post") != "yes":
            return self._confirm(request, queryset, "cancel_pending", "Cancel delayed tasks?")
        from ...delays.admin import report_cancelled
        from .overview import celery_app

        store = DjangoStore(using=queryset.db)
        ids = list(queryset.filter(status__in=sorted(C.DELAY_CANCELLABLE_STATUSES)).values_list("id", flat=True))
        app = celery_app()
        cancelled = 0
        for task_id in ids:
            if store.cancel(task_id):
                cancelled += 1
                signals.delay_cancelled.send(sender=store, task_id=task_id)
                report_cancelled(app, store, task_id)  # REVOKED, as cancel() reports it
        self.message_user(request, f"Cancelled {cancelled} delayed task(s) that had not started.", messages.SUCCESS)
        return None

    @admin.action(description="Reschedule selected delayed tasks that have not started", permissions=["change"])
    def reschedule_pending(self, request: Any, queryset: Any) -> TemplateResponse | None:
        if request.POST.get("post") != "yes":
            initial = {"due_at": DjangoStore(using=queryset.db).now().replace(microsecond=0, tzinfo=None)}
            return self._confirm(
                request, queryset, "reschedule_pending", "Reschedule delayed tasks", RescheduleForm(initial=initial)
            )
        form = RescheduleForm(request.POST)
        with timezone.override(UTC):  # the field is UTC whatever the project's TIME_ZONE
            valid = form.is_valid()
        if not valid:
            return self._confirm(request, queryset, "reschedule_pending", "Reschedule delayed tasks", form)
        due_at = as_utc(form.cleaned_data["due_at"])
        store = DjangoStore(using=queryset.db)
        ids = list(queryset.filter(status__in=sorted(C.DELAY_CANCELLABLE_STATUSES)).values_list("id", flat=True))
        moved = sum(1 for task_id in ids if store.reschedule(task_id, due_at))
        self.message_user(
            request,
            f"Rescheduled {moved} delayed task(s) that had not started to {due_at:%Y-%m-%d %H:%M:%S} UTC.",
            messages.SUCCESS,
        )
        return None

    @admin.action(description="Run selected failed or expired delayed tasks again", permissions=["change"])
    def rerun_failed(self, request: Any, queryset: Any) -> TemplateResponse | None:
        if request.POST.get("post") != "yes":
            return self._confirm(
                request, queryset, "rerun_failed", "Run delayed tasks again?", changes=C.DELAY_RERUNNABLE_STATUSES
            )
        store = DjangoStore(using=queryset.db)
        ids = list(queryset.filter(status__in=sorted(C.DELAY_RERUNNABLE_STATUSES)).values_list("id", flat=True))
        rerun = sum(1 for task_id in ids if store.rerun(task_id))
        self.message_user(
            request, f"{rerun} failed or expired delayed task(s) are pending again, due now.", messages.SUCCESS
        )
        return None

    # --- the overview page ---------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        overview = path("overview/", self.admin_site.admin_view(self.overview_view), name="celery_safe_time_overview")
        # Any stored name has a page: ``[\s\S]`` takes newlines too (django-celery-beat rows are not
        # checked as ``save_entry`` checks names); an empty name has none and is listed unlinked.
        entry = re_path(
            r"^overview/entry/(?P<name>[\s\S]+)/$",
            self.admin_site.admin_view(self.entry_view),
            name="celery_safe_time_entry",
        )
        return [overview, entry, *super().get_urls()]

    def can_view_entries(self, request: HttpRequest) -> bool:
        """Whether the user may see beat entries' definitions, runs and changes (args, kwargs, headers).

        With django-celery-beat installed that takes its ``view_periodictask`` permission as well as
        ours, so a staff user refused its admin is not shown the same rows here."""
        from django.apps import apps

        if not self.has_view_permission(request):
            return False
        if not apps.is_installed("django_celery_beat"):
            return True
        return bool(request.user.has_perm(DCB_VIEW_PERMISSION))

    def entry_view(self, request: HttpRequest, name: str) -> HttpResponse:
        """One beat entry's last runs and changes (read-only: ``entry_history``, ``entry_audit``)."""
        if not self.can_view_entries(request):
            raise PermissionDenied
        from .overview import celery_app, entry_page

        try:
            page, app_error = entry_page(celery_app(), name), None
        except (ImportError, AttributeError, TypeError, SafeTimeError) as exc:
            page, app_error = None, f"{exc.__class__.__name__}: {exc}"
        context = {
            **self.admin_site.each_context(request),
            "title": f"Beat entry {name}",
            "opts": self.model._meta,
            "name": name,
            "page": page,
            "app_error": app_error,
        }
        return TemplateResponse(request, "admin/celery_safe_time/entry.html", context)

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        from .overview import celery_app, gather

        try:
            app = celery_app()
            entries = self.can_view_entries(request)
            # one page of entries at a time (?after=NAME&prefix=P): a schedule may hold a million
            view = gather(
                app,
                database_entries=entries,
                after=request.GET.get("after") or None,
                prefix=request.GET.get("prefix") or None,
            )
            for entry in view.entries:
                entry.url = _entry_url(entry.name) if entries else None
            app_error = None
        except (ImportError, AttributeError, TypeError, SafeTimeError) as exc:  # no app, or its settings are wrong
            view, app_error = None, f"{exc.__class__.__name__}: {exc}"
        context = {
            **self.admin_site.each_context(request),
            "title": "Safe time",
            "opts": self.model._meta,
            "view": view,
            "app_error": app_error,
            "chart": mark_safe(due_chart_svg(view.buckets)) if view and view.buckets else "",
        }
        return TemplateResponse(request, "admin/celery_safe_time/overview.html", context)


def _entry_url(name: str) -> str | None:
    """The entry page of ``name``, or None for a name no URL can hold (an empty one)."""
    try:
        return str(reverse("admin:celery_safe_time_entry", kwargs={"name": name}))
    except NoReverseMatch:
        return None
