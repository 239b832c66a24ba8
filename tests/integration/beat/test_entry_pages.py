"""The operator views' pages and counts on real Redis and PostgreSQL, a few thousand runtime entries:
pages cover every entry exactly once, in name order, with a prefix and a state filter; the counts
are the backend's. On Redis, the name index heals (deleted names, a deleted index); and
``celery safe-time beat list`` follows its cursor through the real command."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time import delete_entry, save_entries
from celery_safe_time.beat.backends import beat_backend
from celery_safe_time.beat.entry_pages import count_entries, page_entries
from celery_safe_time.beat.state import dump_state
from celery_safe_time.config import get_config
from tests.helpers.beat import BEAT_APP, beat_env
from tests.helpers.processes import ProcessManager

pytestmark = pytest.mark.integration

ENTRIES = 3000
CONFIG = {"cfg": {"task": "tests.record", "every": 3600, "args": ["cfg"]}}


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture
def app(make_app: Callable[..., Celery], coordination: dict[str, Any]) -> Celery:
    settings = {"safe_time_key_prefix": f"pages-{uuid.uuid4().hex[:8]}:", **coordination}
    app = make_app(beat_schedule={"tenant-cfg": {"task": "t.pages_noop", "schedule": 60.0}}, **settings)
    app.task(name="t.pages_noop", shared=False)(_noop)
    return app


def _items(n: int) -> list[dict[str, Any]]:
    # unpadded numbers: name order is not number order; every 7th paused; a few under another prefix
    return [
        {"name": f"tenant-{i}" if i % 10 else f"other-{i}", "task": "t.pages_noop", "schedule": 3600.0,
         "enabled": i % 7 != 0}
        for i in range(n)
    ]  # fmt: skip


def _all_pages(app: Celery, **filters: Any) -> list[str]:
    seen: list[str] = []
    after = None
    while True:
        page = page_entries(app=app, after=after, **filters)
        seen += [info.name for info in page.entries]
        if page.after is None:
            return seen
        assert page.after > (after or "")
        after = page.after


def test_pages_cover_every_entry_once_in_name_order(app: Celery) -> None:
    items = _items(ENTRIES)
    save_entries(items, app=app)
    names = sorted([item["name"] for item in items] + ["tenant-cfg"])
    assert _all_pages(app, limit=450) == names
    tenants = [n for n in names if n.startswith("tenant-1")]
    assert _all_pages(app, limit=100, prefix="tenant-1") == tenants
    paused = sorted(item["name"] for item in items if not item["enabled"])
    assert _all_pages(app, limit=100, state="paused", scan=700) == paused
    assert _all_pages(app, limit=1000, state="active", prefix="other-") == sorted(
        item["name"] for item in items if item["enabled"] and item["name"].startswith("other-")
    )
    # deleted entries leave the pages
    for name in names[1:4]:
        assert delete_entry(name, app=app)
    assert _all_pages(app, limit=450) == [names[0], *names[4:]]


def test_counts_come_from_the_indexes(app: Celery) -> None:
    save_entries(_items(ENTRIES), app=app)
    backend = beat_backend(get_config(app))
    lease = backend.make_lease()
    now = backend.clock.time()
    assert lease.acquire(now) is not None
    nexts = {f"tenant-{i}": now + (30 if i < 40 else 7200) for i in range(1, 100) if i % 10}
    states = {name: dump_state(None, next_fire, "s") for name, next_fire in nexts.items()}
    # the saves planned each enabled entry's first slot: this plan replaces them
    planned_by_saves = [item["name"] for item in _items(ENTRIES) if item["name"] not in nexts]
    assert backend.write_plan(lease.token, states, nexts, planned_by_saves, [])
    lease.release()
    counts = count_entries(app, soon=300)
    assert counts == {
        "config": 1,
        "runtime": ENTRIES,
        "scheduled": len(nexts),
        "due_soon": sum(1 for value in nexts.values() if value <= now + 300),
        "soon_s": 300,
    }
    assert [info.name for info in page_entries(app=app, state="due-soon", soon=300, limit=1000).entries] == sorted(
        name for name, value in nexts.items() if value <= now + 300
    )


@pytest.mark.parametrize("coordination", ["redis"], indirect=True)  # PostgreSQL pages its table's index
def test_the_redis_name_index_heals(app: Celery, coordination: dict[str, Any], redis_url: str) -> None:
    items = _items(500)
    save_entries(items, app=app)
    names = sorted([item["name"] for item in items] + ["tenant-cfg"])
    assert _all_pages(app, limit=100) == names
    config = get_config(app)
    client = redis.Redis.from_url(redis_url)
    # a deletion whose tombstone is pruned before any page saw it: the index still holds the name
    assert delete_entry("tenant-1", app=app)
    client.zrem(config.key("beat:entries:changed"), "tenant-1")
    assert _all_pages(app, limit=100) == [n for n in names if n != "tenant-1"]
    assert client.zscore(config.key("beat:entries:names"), "tenant-1") is None
    # the index deleted (evicted, or an older version's keys): the next page builds it again
    client.delete(config.key("beat:entries:names"), config.key("beat:entries:names:version"))
    assert _all_pages(app, limit=100) == [n for n in names if n != "tenant-1"]


def test_beat_list_pages_through_the_command(
    processes: ProcessManager, coordination: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    conf = {"safe_time_key_prefix": f"pagescli-{uuid.uuid4().hex[:8]}:", **coordination}
    env = beat_env(CONFIG, **conf)
    lines = tmp_path / "entries.jsonl"
    items = [
        {"name": f"job-{i:02d}", "task": "tests.record", "schedule": 3600.0, "enabled": i % 4 != 0} for i in range(30)
    ]
    lines.write_text("".join(json.dumps(item) + "\n" for item in items))
    imported = processes.cli(BEAT_APP, "safe-time", "beat", "import", str(lines), env=env)
    assert imported.returncode == 0, imported.stderr

    seen: list[str] = []
    after: list[str] = []
    for _ in range(10):
        listed = processes.cli(BEAT_APP, "safe-time", "beat", "list", "--prefix", "job-", "--limit", "8",
                                   "--json", *after, env=env)  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        page = json.loads(listed.stdout)
        assert len(page) <= 8
        seen += [item["name"] for item in page]
        more = [line for line in listed.stderr.splitlines() if line.startswith("more entries: --after ")]
        if not more:
            break
        after = ["--after", more[0].removeprefix("more entries: --after ")]
    assert seen == [item["name"] for item in items]

    paused = processes.cli(BEAT_APP, "safe-time", "beat", "list", "--state", "paused", env=env)
    assert paused.returncode == 0, paused.stderr
    rows = paused.stdout.splitlines()
    assert [row.split()[0] for row in rows[1:-1]] == [item["name"] for item in items if not item["enabled"]]
    assert rows[-1].startswith("8 entries (of 1 config and 30 runtime stored;")
