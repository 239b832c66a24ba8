"""The admin in a real browser: Playwright driving Debian's Chromium against a live Django server.

The server is pytest-django's ``live_server`` (a thread on a free loopback port serving the admin
and its static files) on the PostgreSQL test database; Redis is the test's db, with a real
``celery beat`` (SafeScheduler) holding the lease. Screenshots of every page go to the test's tmp
dir; ``SAFE_TIME_ADMIN_SCREENSHOT=1`` also writes the overview to ``docs/img/admin-overview.png``
(the README's picture):

    SAFE_TIME_ADMIN_SCREENSHOT=1 .venv/bin/python -m pytest tests/integration/test_admin_browser.py

Chromium is Debian's (``apt-get install chromium``), never a browser Playwright downloads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import constants as C
from celery_safe_time import save_entry
from celery_safe_time.contrib.django.chart import hour_start
from celery_safe_time.contrib.django.models import DelayedTask
from celery_safe_time.contrib.django.store import DjangoStore
from tests.helpers import services
from tests.helpers.admin import hold_lock
from tests.helpers.beat import beat_env, leader_pid
from tests.helpers.delays import new_delay
from tests.helpers.processes import ProcessManager, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
DOCS_SCREENSHOT = ROOT / "docs" / "img" / "admin-overview.png"
CHANGELIST = "/admin/celery_safe_time/delayedtask/"
OVERVIEW = CHANGELIST + "overview/"

#: Debian's Chromium under Playwright: no sandbox (root in a container), no GPU, and nothing that
#: reaches out on its own (updates, sync, field trials, QUIC), with a fresh profile per test.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def chromium_binary() -> str:
    binary = shutil.which("chromium")
    if binary is None:
        services.unavailable("Chromium", "chromium", "no chromium binary on PATH")
    assert binary is not None
    return binary


@pytest.fixture
def browser_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    binary = chromium_binary()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:  # the dev extras install it
        if services.IN_CI:
            pytest.fail(f"the playwright package is missing ({exc}): pip install -e '.[dev]'", pytrace=False)
        pytest.skip(f"the playwright package is missing: {exc}")
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls between
    # browser steps are plain synchronous code all the same.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path)
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=binary,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            page = context.new_page()
            page.set_default_timeout(30_000)
            yield page
        finally:
            context.close()


def _seed(app: Celery) -> dict[str, str]:
    """Rows a small SaaS would have: reminders spread over two days, one overdue, one failed."""
    store = DjangoStore()
    now = store.now()
    hour = hour_start(now)
    for i in range(24):
        due = hour + timedelta(hours=1 + (i * 7) % 47, minutes=(i * 13) % 60)
        store.insert(new_delay(f"reminder-{i:02d}", due, task="billing.send_reminder"))
    for i in range(6):
        store.insert(new_delay(f"trial-end-{i}", hour + timedelta(hours=9, minutes=i * 5), task="trials.trial_ending"))
    store.insert(new_delay("nudge-overdue", now - timedelta(seconds=40), task="trials.nudge"))
    store.insert(new_delay("invoice-failed", now + timedelta(hours=2), task="billing.send_invoice"))
    DelayedTask.objects.filter(id="invoice-failed").update(status=C.STATUS_FAILED, last_error="broker refused")
    store.insert(new_delay("to-cancel", hour + timedelta(hours=3), task="trials.trial_ending"))
    save_entry("tenant-7-report", "tests.record", timedelta(hours=1), args=("report-7",), app=app)
    hold_lock(app, "inventory-sync:3", task_id="7f3c9a42-sync", host="worker-2.example")
    return {"cancel": "to-cancel"}


def _record(label: str) -> None:
    """Stands in for ``tests.apps.basic.record`` in this process (nothing runs it here)."""


def _shot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / "screenshots" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, f"{name}: an empty screenshot"
    return path


def test_admin_in_chromium_login_styles_overview_chart_and_cancel(
    browser_page: Any,
    live_server: Any,
    admin_user: Any,
    make_app: Callable[..., Celery],
    processes: ProcessManager,
    redis_client: redis.Redis,
    settings: Any,
    tmp_path: Path,
) -> None:
    page = browser_page
    schedule = {
        "nightly-invoices": {"task": "tests.record", "every": 86400, "args": ["invoices"]},
        "inventory-sync": {"task": "tests.record", "every": 300, "args": ["sync"]},
    }
    beat = processes.beat("tests.apps.beat_app", name="beat", env=beat_env(schedule, safe_time_beat_lease=30))
    app = make_app("admin-browser", safe_time_store_url="django")
    app.conf.beat_schedule = {name: {"task": s["task"], "schedule": float(s["every"])} for name, s in schedule.items()}
    app.task(name="tests.record", shared=False)(_record)  # what the beat app runs; runtime entries check it
    settings.SAFE_TIME_CELERY_APP = app
    seeded = _seed(app)
    wait_for(lambda: leader_pid(redis_client) == beat.pid, timeout=60, message="the beat took the lease")

    stylesheets: list[tuple[str, int]] = []
    page.on(
        "response",
        lambda response: (
            stylesheets.append((response.url, response.status))
            if response.request.resource_type == "stylesheet"
            else None
        ),
    )

    # --- log in; the admin's own stylesheets load ---
    page.goto(live_server.url + "/admin/login/?next=/admin/")
    _shot(page, tmp_path, "login")
    page.fill("#id_username", admin_user.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")
    base_css = [status for url, status in stylesheets if url.endswith("/static/admin/css/base.css")]
    assert base_css, stylesheets
    assert all(status == 200 for status in base_css), stylesheets
    # and they apply: the header has the admin's colour, not the browser's default white
    header_bg = page.eval_on_selector("#header", "el => getComputedStyle(el).backgroundColor")
    assert header_bg not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)"), header_bg
    _shot(page, tmp_path, "index")

    # --- the overview: the leader, the entries, the chart, the lock ---
    page.goto(live_server.url + OVERVIEW)
    assert page.inner_text("#leader-pid") == str(beat.pid)
    assert page.inner_text("#leader-host")
    assert page.locator("#no-leader").count() == 0
    entries = page.inner_text("#entries")
    for name in ("nightly-invoices", "inventory-sync", "tenant-7-report"):
        assert name in entries
    assert page.locator("#due-chart svg").count() == 1
    bars = page.locator("#due-chart svg rect.bar")
    assert bars.count() >= 10
    box = bars.first.bounding_box()
    assert box is not None
    assert box["height"] > 0  # drawn, not just in the markup
    assert box["width"] > 0
    assert "inventory-sync:3" in page.inner_text("#locks")
    assert page.inner_text("#delays-failed") == "1"
    overview_png = _shot(page, tmp_path, "overview")
    if os.environ.get("SAFE_TIME_ADMIN_SCREENSHOT"):
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(overview_png, DOCS_SCREENSHOT)

    # --- the changelist: decoded arguments; cancel one pending row through the confirmation page ---
    page.goto(live_server.url + CHANGELIST + "?status__exact=pending&q=" + seeded["cancel"])
    assert '"to-cancel"' in page.inner_text("#result_list")
    _shot(page, tmp_path, "changelist")
    page.check(f"input[name=_selected_action][value={seeded['cancel']}]")
    page.select_option("select[name=action]", "cancel_pending")
    page.click("button[name=index]")
    page.wait_for_selector("#safe-time-confirm")
    assert DelayedTask.objects.get(id=seeded["cancel"]).status == C.STATUS_PENDING
    _shot(page, tmp_path, "cancel-confirm")
    page.click("#safe-time-confirm input[type=submit]")
    page.wait_for_selector("ul.messagelist")
    assert "Cancelled 1 delayed task(s)" in page.inner_text("ul.messagelist")
    assert DelayedTask.objects.get(id=seeded["cancel"]).status == C.STATUS_CANCELLED

    # --- the reschedule form and a read-only detail page ---
    page.goto(live_server.url + CHANGELIST + "?q=reminder-00")
    page.check("input[name=_selected_action][value=reminder-00]")
    page.select_option("select[name=action]", "reschedule_pending")
    page.click("button[name=index]")
    page.wait_for_selector("input#id_due_at[type=datetime-local]")
    _shot(page, tmp_path, "reschedule-form")
    new_due = (DjangoStore().now() + timedelta(days=4)).replace(microsecond=0)
    page.fill("input#id_due_at", new_due.strftime("%Y-%m-%dT%H:%M:%S"))
    page.click("#safe-time-confirm input[type=submit]")
    page.wait_for_selector("ul.messagelist")
    assert "Rescheduled 1 delayed task(s)" in page.inner_text("ul.messagelist")
    assert DelayedTask.objects.get(id="reminder-00").due_at == new_due
    page.goto(live_server.url + CHANGELIST + "reminder-00/change/")
    assert page.locator("input[name=_save]").count() == 0
    _shot(page, tmp_path, "detail")
    shots = sorted(p.name for p in (tmp_path / "screenshots").iterdir())
    assert shots == sorted(
        f"{n}.png" for n in ("login", "index", "overview", "changelist", "cancel-confirm", "reschedule-form", "detail")
    )
