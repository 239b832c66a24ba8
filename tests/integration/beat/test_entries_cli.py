"""``celery safe-time beat list|show|add|remove|pause|resume|run-now`` through the real ``celery`` command:
in this process (click's runner, the same command code) where a test reads only the output, six real
processes where they race."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery

from celery_safe_time.beat.backends import beat_backend
from celery_safe_time.config import get_config
from tests.helpers.beat import BEAT_APP, beat_env, holder_pid, runs
from tests.helpers.processes import ROOT, ProcessManager, wait_for

pytestmark = pytest.mark.integration


def _slot(run: dict[str, Any]) -> float:
    return datetime.fromisoformat(run["headers"]["safe_time_slot"]).timestamp()


CONFIG = {"cfg": {"task": "tests.record", "every": 3600, "args": ["cfg"]}}


def _beat(processes: ProcessManager, coordination: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return processes.cli(BEAT_APP, "safe-time", "beat", *args, env=beat_env(CONFIG, **coordination))


def _stored(redis_url: str, coordination: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The runtime definitions stored and the change counter, on the backend of ``coordination``."""
    app = Celery("cli", set_as_current=False)
    app.conf.update(broker_url=redis_url, **coordination)
    backend = beat_backend(get_config(app))
    return backend.entry_definitions(), backend.read_due(0.0, 1).version


def test_add_list_show_pause_resume_remove(processes: ProcessManager, coordination: dict[str, Any]) -> None:
    added = _beat(
        processes, coordination, "add", "tenant-42-report", "tests.record", "--cron", "0 9 * * *",
        "--tz", "Europe/Berlin", "--args", '["t42"]', "--kwargs", '{"sleep": 0}',
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert "tenant-42-report: cron 0 9 * * * tz=Europe/Berlin -> tests.record (version 1)" in added.stdout
    assert _beat(processes, coordination, "add", "every-5", "tests.record", "--every", "5").returncode == 0
    at = _beat(processes, coordination, "add", "once", "tests.record", "--at", "2030-01-01T09:00:00+01:00")
    assert at.returncode == 0, at.stderr

    listed = _beat(processes, coordination, "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "SOURCE", "STATE", "SCHEDULE"]
    assert [line.split()[:3] for line in lines[1:-1]] == [
        ["cfg", "config", "enabled"],
        ["every-5", "runtime", "enabled"],
        ["once", "runtime", "enabled"],
        ["tenant-42-report", "runtime", "enabled"],
    ]
    assert lines[-1].startswith("4 entries (of 1 config and 3 runtime stored;")

    shown = _beat(processes, coordination, "show", "tenant-42-report")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["schedule"]["tz"] == "Europe/Berlin"
    assert (data["args"], data["kwargs"], data["source"]) == (["t42"], {"sleep": 0}, "runtime")

    assert _beat(processes, coordination, "pause", "every-5").stdout.strip() == "every-5: paused"
    entries = {
        e["name"]: e for e in json.loads(_beat(processes, coordination, "list", "--json", "--prefix", "every").stdout)
    }
    assert list(entries) == ["every-5"]
    assert entries["every-5"]["enabled"] is False
    assert _beat(processes, coordination, "resume", "every-5").stdout.strip() == "every-5: resumed"
    assert _beat(processes, coordination, "remove", "every-5").stdout.strip() == "every-5: removed"
    missing = _beat(processes, coordination, "remove", "every-5")
    assert missing.returncode == 1
    assert "no runtime entry 'every-5'" in missing.stderr
    # a removed entry: its records remain, and show who removed it
    removed = _beat(processes, coordination, "show", "every-5")
    assert removed.returncode == 0, removed.stderr
    shown = json.loads(removed.stdout)
    assert shown["source"] is None
    assert shown["changes"][0]["action"] == "delete"
    assert "no config or runtime entry" in removed.stderr
    assert _beat(processes, coordination, "show", "never-was").returncode == 1


def test_bad_input_exits_non_zero_and_stores_nothing(
    processes: ProcessManager, redis_url: str, coordination: dict[str, Any]
) -> None:
    unknown = _beat(processes, coordination, "add", "x", "no.such.task", "--every", "5")
    assert unknown.returncode == 1
    assert "unknown task 'no.such.task'" in unknown.stderr
    bad_cron = _beat(processes, coordination, "add", "x", "tests.record", "--cron", "0 25 * * *")
    assert bad_cron.returncode == 1
    assert "hour" in bad_cron.stderr
    bad_args = _beat(processes, coordination, "add", "x", "tests.record", "--every", "5", "--args", "{not json")
    assert bad_args.returncode == 2
    both = _beat(processes, coordination, "add", "x", "tests.record", "--every", "5", "--at", "2030-01-01T00:00:00")
    assert both.returncode == 2
    assert "exactly one of --cron, --every or --at" in both.stderr
    conflict = _beat(processes, coordination, "add", "cfg", "tests.record", "--every", "5")
    assert conflict.returncode == 1
    assert "runtime entry 'cfg'" in conflict.stderr
    assert "config entry 'cfg'" in conflict.stderr
    bad_jitter = _beat(processes, coordination, "add", "x", "tests.record", "--every", "5", "--jitter", "5")
    assert bad_jitter.returncode == 1
    assert "entry 'x': safe_time_jitter (5 s) must be shorter than its interval" in bad_jitter.stderr
    bad_window = _beat(processes, coordination, "add", "x", "tests.record", "--every", "5", "--catchup-window", "-1")
    assert bad_window.returncode == 1
    assert "entry 'x': safe_time_catchup_window must be above 0 seconds" in bad_window.stderr
    assert _stored(redis_url, coordination) == ({}, 0)


def test_add_with_jitter_and_a_catch_up_window_shows_them(
    processes: ProcessManager, coordination: dict[str, Any]
) -> None:
    added = _beat(
        processes, coordination, "add", "spread", "tests.record", "--cron", "0 * * * *",
        "--jitter", "30", "--catchup-window", "3600",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    shown = _beat(processes, coordination, "show", "spread")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["options"] == {"safe_time_jitter": 30.0, "safe_time_catchup_window": 3600.0}
    assert info["next_fire"].endswith(":00:00+00:00")  # the slot, not the jittered instant


def test_six_processes_adding_the_same_entry_make_one_change(
    processes: ProcessManager, redis_url: str, coordination: dict[str, Any]
) -> None:
    cmd = [sys.executable, "-m", "celery", "-A", BEAT_APP, "safe-time", "beat", "add", "tenant-1", "tests.record"]
    cmd += ["--cron", "0 9 * * *", "--tz", "Europe/Berlin"]
    env = {**processes.env, **beat_env(CONFIG, **coordination), "PYTHONPATH": str(ROOT)}
    env = {**os.environ, **env}
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    definitions, version = _stored(redis_url, coordination)
    assert version == 1
    assert list(definitions) == ["tenant-1"]


def test_run_now_publishes_one_slot_through_the_guard(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    env = beat_env(CONFIG, safe_time_beat_lease=6.0, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    processes.beat(BEAT_APP, env=env, name="beat")
    wait_for(lambda: holder_pid(redis_client, coordination), 30, message="a leader")
    wait_for(lambda: runs(redis_client, "cfg"), 30, message="the config entry's first slot")
    done = _beat(processes, coordination, "run-now", "cfg")
    assert done.returncode == 0, done.stderr
    slot = done.stdout.strip().rsplit(" ", 1)[-1]
    wait_for(lambda: len(runs(redis_client, "cfg")) == 2, 20, message="the run-now run")
    assert [r["headers"]["safe_time_slot"] for r in runs(redis_client, "cfg")][1] == slot
    assert _beat(processes, coordination, "run-now", "nope").returncode == 1


def test_pause_with_a_note_and_an_expiry_resumes_by_itself_at_the_next_slot(
    processes: ProcessManager, redis_client: redis.Redis, coordination: dict[str, Any]
) -> None:
    env = beat_env(CONFIG, safe_time_beat_lease=6.0, **coordination)
    processes.worker(BEAT_APP, env=env, name="worker")
    processes.beat(BEAT_APP, env=env, name="beat")
    wait_for(lambda: holder_pid(redis_client, coordination), 30, message="a leader")
    added = _beat(processes, coordination, "add", "every-2", "tests.record", "--every", "2", "--args", '["e2"]')
    assert added.returncode == 0, added.stderr
    wait_for(lambda: runs(redis_client, "e2"), 30, message="a first run")

    paused = _beat(processes, coordination, "pause", "every-2", "--note", "db migration (ops)", "--until", "8")
    assert paused.returncode == 0, paused.stderr
    assert "every-2: paused until " in paused.stdout
    assert "(db migration (ops))" in paused.stdout
    shown = json.loads(_beat(processes, coordination, "show", "every-2").stdout)
    assert (shown["enabled"], shown["pause_note"]) == (False, "db migration (ops)")
    until = datetime.fromisoformat(shown["paused_until"]).timestamp()
    assert shown["next_fire"] is None

    # the leader resumes it by itself at the expiry: nothing runs between, then its next slots only
    wait_for(lambda: any(_slot(r) > until for r in runs(redis_client, "e2")), 40, message="a run after the expiry")
    slots = sorted(_slot(r) for r in runs(redis_client, "e2"))
    pause_took = until - 8  # when the pause was stored (the CLI's "now" plus 8 s)
    during = [s for s in slots if pause_took + 1 < s <= until]
    assert during == [], slots  # no slot of the pause, not even as a catch-up
    assert all((b - a) % 2 == 0 for a, b in itertools.pairwise(slots))  # the same grid
    resumed = json.loads(_beat(processes, coordination, "show", "every-2").stdout)
    assert (resumed["enabled"], resumed["pause_note"], resumed["paused_until"]) == (True, None, None)

    bad = _beat(processes, coordination, "pause", "every-2", "--until", "2001-01-01T00:00:00")
    assert bad.returncode == 1
    assert "entry 'every-2': pause until 2001-01-01T00:00:00+00:00 is not in the future" in bad.stderr
    unparsable = _beat(processes, coordination, "pause", "every-2", "--until", "tomorrow")
    assert unparsable.returncode == 2
