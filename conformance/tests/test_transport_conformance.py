"""The transport suite against every built-in transport, each resolved by plugin name."""

from __future__ import annotations

import importlib

import pytest

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_conformance.suites.transport import TransportHarness, TransportSuite


def harness_for(name: str, **options: object) -> TransportHarness:
    descriptor = get_registry().get(PluginKind.TRANSPORT, name)
    assert descriptor.conformance_harness is not None, f"{name} ships no conformance harness"
    module_name, _, attribute = descriptor.conformance_harness.partition(":")
    harness = getattr(importlib.import_module(module_name), attribute)(options)
    assert isinstance(harness, TransportHarness)
    assert harness.capabilities <= descriptor.capabilities | {"processes", "malformed_input"}
    return harness


class TestMemoryTransport(TransportSuite):
    @pytest.fixture
    def harness(self) -> TransportHarness:
        return harness_for("memory")


class TestZmqTcpTransport(TransportSuite):
    """Real sockets over tcp:// on loopback; peers are real processes."""

    @pytest.fixture
    def harness(self) -> TransportHarness:
        return harness_for("zmq")


class TestZmqIpcTransport(TransportSuite):
    """Real sockets over ipc://; peers are real processes."""

    @pytest.fixture
    def harness(self) -> TransportHarness:
        return harness_for("zmq", scheme="ipc")


class TestZmqTransportWithoutCoalescing(TransportSuite):
    """Every frame its own ZeroMQ message: the same promises hold."""

    @pytest.fixture
    def harness(self) -> TransportHarness:
        return harness_for("zmq", coalesce=False)
