import time
from tests.helpers.beat import beat_env, runs, BEAT_APP

def test_smoke(processes, redis_client):
    env = beat_env({"tick": {"task": "tests.record", "every": 1, "args": ["tick"]}, "cron": {"task": "tests.record", "cron": {"minute": "*"}, "args": ["cron"]}}, safe_time_beat_lease=6)
    b = processes.beat(BEAT_APP, env=env, name="b1")
    w = processes.worker(BEAT_APP, env=env, name="w1")
    time.sleep(12)
    print(b.log()[-3000:])
    print([ (x["label"], x["headers"]) for x in runs(redis_client)][:5], len(runs(redis_client)))
    assert 0
