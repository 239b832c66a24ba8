"""The harness itself: real worker subprocesses that can be paused, resumed and killed."""

from __future__ import annotations

import json

import pytest
import redis

from tests.helpers.processes import ProcessManager, wait_for

pytestmark = pytest.mark.integration


def _runs(client: redis.Redis) -> list[dict[str, object]]:
    return [json.loads(r) for r in client.lrange("test:runs", 0, -1)]


def test_worker_subprocess_runs_tasks_and_obeys_signals(
    processes: ProcessManager, redis_client: redis.Redis, make_app
) -> None:  # type: ignore[no-untyped-def]
    worker = processes.worker("tests.apps.basic", concurrency=1, pool="solo")
    worker.wait_for_log(r"ready\.", timeout=90)
    app = make_app()
    app.send_task("tests.record", args=["first"])
    wait_for(lambda: len(_runs(redis_client)) == 1, 60, message="first run")

    worker.pause()
    app.send_task("tests.record", args=["while-paused"])
    # A stopped worker runs nothing; give it a moment to prove it.
    with pytest.raises(AssertionError):
        wait_for(lambda: len(_runs(redis_client)) == 2, 2, message="no run while paused")
    worker.resume()
    wait_for(lambda: len(_runs(redis_client)) == 2, 60, message="run after SIGCONT")

    worker.kill()
    assert not worker.alive()
    assert [r["label"] for r in _runs(redis_client)] == ["first", "while-paused"]


def test_terminate_is_graceful(processes: ProcessManager) -> None:
    worker = processes.worker("tests.apps.basic", concurrency=1, pool="solo")
    worker.wait_for_log(r"ready\.", timeout=90)
    code = worker.terminate()
    assert code == 0


def test_a_process_is_watched_and_killed_from_several_threads_at_once(processes: ProcessManager) -> None:
    """The soak's fault injector kills a process while its supervisor and the test poll it: no
    thread fails (a second reader of the zygote's socket read it after the first closed it: EBADF),
    and every thread sees the same exit code."""
    import threading

    worker = processes.worker("tests.apps.basic", concurrency=1, pool="solo")
    worker.wait_for_log(r"ready\.", timeout=90)
    errors: list[BaseException] = []
    codes: list[int | None] = []
    start = threading.Barrier(9)

    def poll() -> None:
        start.wait()
        try:
            while worker.alive():
                pass
            codes.append(worker.proc.poll() if worker.proc else None)
        except BaseException as exc:  # any failure of a watcher is the finding
            errors.append(exc)

    def kill() -> None:
        start.wait()
        try:
            worker.kill()
            codes.append(worker.wait(5))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=poll) for _ in range(8)] + [threading.Thread(target=kill)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert codes == [-9] * 9


def test_processes_a_killed_pytest_process_started_do_not_outlive_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A pytest process killed mid-test leaves no `celery` process behind: the zygote stops the ones
    it started when its pytest process is gone (strays would consume from the next run's queues)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.zygote import ROOT, zygote_env

    client = (
        "import sys, time\n"
        "from tests.helpers.zygote import Zygote, zygote_env\n"
        "proc = Zygote.get().start(['-b', 'memory://', 'inspect', 'ping', '--timeout', '120'],"
        " zygote_env(), sys.argv[1], sys.argv[1] + '/celery.log')\n"
        "print(proc.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    pytest_like = subprocess.Popen(
        [sys.executable, "-c", client, str(tmp_path)], stdout=subprocess.PIPE, env=zygote_env(), cwd=str(ROOT)
    )
    assert pytest_like.stdout is not None
    child = int(pytest_like.stdout.readline())

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # a killed process whose zygote has gone is reaped by init; until then it is a zombie
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"

    time.sleep(1)
    assert alive(child), (tmp_path / "celery.log").read_text()
    pytest_like.send_signal(signal.SIGKILL)
    pytest_like.wait(10)
    wait_for(lambda: not alive(child), 15, message="the forked celery process to be stopped with its pytest process")


def _live_test_vhosts() -> set[str]:
    import subprocess

    listed = subprocess.run(["rabbitmqctl", "-q", "list_vhosts"], capture_output=True, text=True, check=True).stdout
    return {name for name in listed.split() if name.startswith("safe-time-")}


@pytest.mark.parametrize("one_call", [True, False], ids=["eval", "documented-commands"])
def test_rabbit_vhosts_are_made_in_batches_each_usable_and_none_left_behind(
    one_call: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kombu import Connection

    from tests.helpers import services

    if not one_call:
        # what a RabbitMQ whose internal functions differ answers to the eval call
        monkeypatch.setattr(services, "vhost_changes", lambda create, delete: "no_such_module:call().")
    vhosts = services.RabbitVhosts(services.resolve_amqp_base())
    try:
        taken = [vhosts.take() for _ in range(services.VHOST_BATCH + 1)]  # two batches
        made = {vhost.name for vhost in [*taken, *vhosts._ready]}
        assert len(made) == 2 * services.VHOST_BATCH
        assert made <= _live_test_vhosts()
        for vhost in (taken[0], taken[-1]):
            with Connection(vhost.url, connect_timeout=5) as conn:
                conn.ensure_connection(max_retries=1)
        for vhost in taken:
            vhosts.give_back(vhost)
    finally:
        vhosts.close()
    assert not made & _live_test_vhosts()
