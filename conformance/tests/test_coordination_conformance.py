"""The coordination conformance suite against the first-party plugins I own here:
the ``memory`` reference and ``zk`` on a real ZooKeeper 3.8 (started once per session)."""

from __future__ import annotations

import pytest

from waltz_conformance.reference.coordination import MemoryCoordinationHarness
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_conformance.suites.coordination import CoordinationHarness, CoordinationSuite


class TestMemoryCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self) -> CoordinationHarness:
        return MemoryCoordinationHarness(name="memory", session_timeout=2.0)


@pytest.mark.system
class TestZooKeeperCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self, zookeeper_server: ZooKeeperServer) -> CoordinationHarness:
        from waltz_coord_zk.testing import conformance_harness

        return conformance_harness({"server": zookeeper_server, "session_timeout": 8.0})
