"""docs/migrating.md, "From celery-redbeat", followed end to end: entries saved by the real
celery-redbeat package are imported with ``celery safe-time beat import-redbeat`` and then fired by
a real ``celery beat -S celery_safe_time.SafeScheduler`` into a real worker, once per slot.

(The import's details, every schedule kind and the last run carried over, are
``tests/integration/beat/test_import_redbeat.py``.)
"""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery
from celery.schedules import schedule as celery_interval

from tests.helpers.beat import BEAT_APP, beat_env, duplicates, runs
from tests.helpers.processes import ProcessManager, wait_for

redbeat = pytest.importorskip("redbeat")

pytestmark = pytest.mark.integration


def test_redbeat_entries_imported_then_fired_by_safe_scheduler(
    processes: ProcessManager, redis_url: str, redis_client: redis.Redis
) -> None:
    # Step 0 of the guide: what a redbeat deployment has (its beats are stopped before the import).
    app = Celery("redbeat-deployment", set_as_current=False)
    app.conf.update(broker_url=redis_url, redbeat_redis_url=redis_url, timezone="UTC")
    entry = redbeat.RedBeatSchedulerEntry(
        "every-2s", "tests.record", celery_interval(timedelta(seconds=2)), args=["from-redbeat"], app=app
    )
    entry.save()
    entry.reschedule(last_run_at=datetime.now(timezone.utc) - timedelta(minutes=5))

    # Step 1: import (dry run first, as the guide shows).
    dry = processes.command(BEAT_APP, "safe-time", "beat", "import-redbeat", "--dry-run", env=beat_env({}))
    assert dry.returncode == 0, dry.stderr
    assert "1 would import" in dry.stdout, dry.stdout
    done = processes.command(BEAT_APP, "safe-time", "beat", "import-redbeat", "--json", env=beat_env({}))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["imported"] == ["every-2s"]

    # Step 2: the same beat command with the scheduler swapped, and the workers as they were.
    processes.worker("tests.apps.basic", env=beat_env({}))
    processes.beat(BEAT_APP, env=beat_env({}), scheduler="celery_safe_time.SafeScheduler")
    wait_for(lambda: len(runs(redis_client, "from-redbeat")) >= 4, 60, message="four runs of the imported entry")

    fired = runs(redis_client, "from-redbeat")
    assert duplicates(redis_client, "from-redbeat") == {}
    slots = sorted(datetime.fromisoformat(r["headers"]["safe_time_slot"]).timestamp() for r in fired)
    assert all(b - a == pytest.approx(2.0) for a, b in itertools.pairwise(slots)), slots
