"""A process that used PostgreSQL coordination closes its pooled connections as it exits, instead of
dropping them unannounced (the server logs a reset per connection; psycopg warns of each)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    import sqlalchemy as sa
    from celery import Celery

    from celery_safe_time.config import get_config
    from celery_safe_time.coordination import coordination_engine

    app = Celery("exit", set_as_current=False)
    app.conf.update(broker_url="memory://", safe_time_coordination_url=sys.argv[1])
    config = get_config(app)
    for autocommit in (False, True):
        with coordination_engine(config, autocommit=autocommit).connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    print("used")
    """
)


def test_pooled_coordination_connections_are_closed_at_exit(postgres_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", SCRIPT, postgres_url],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "used"
    assert "ResourceWarning" not in done.stderr, done.stderr
