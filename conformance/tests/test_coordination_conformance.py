"""The coordination conformance suite against the first-party plugins I own here:
the ``memory`` reference and ``zk`` on a real ZooKeeper 3.8 (started once per session)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_conformance.reference.coordination import MemoryCoordinationHarness
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_conformance.suites.coordination import (
    CROSS_PROCESS,
    SERVER_RESTART,
    CoordinationHarness,
    CoordinationSuite,
)


class TestMemoryCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self) -> CoordinationHarness:
        return MemoryCoordinationHarness(name="memory", session_timeout=2.0)


@pytest.mark.system
class TestZooKeeperCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self, zookeeper_server: ZooKeeperServer) -> CoordinationHarness:
        from waltz_coord_zk.conformance import harness as conformance_harness

        return conformance_harness({"server": zookeeper_server, "session_timeout": 8.0})


def _load(spec: str) -> Any:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def test_descriptors_name_working_harnesses(zookeeper_server: ZooKeeperServer) -> None:
    registry = get_registry()
    memory = registry.resolve(PluginKind.COORDINATION, "memory://x/y")
    zk = registry.resolve(PluginKind.COORDINATION, zookeeper_server.uri("/z"))
    assert (memory.name, zk.name) == ("memory", "zk")
    assert memory.conformance_harness is not None and zk.conformance_harness is not None
    memory_harness = _load(memory.conformance_harness)()
    assert isinstance(memory_harness, CoordinationHarness) and memory_harness.name == "memory"
    zk_harness = _load(zk.conformance_harness)({"server": zookeeper_server})
    assert isinstance(zk_harness, CoordinationHarness)
    assert {SERVER_RESTART, CROSS_PROCESS} <= zk_harness.capabilities
