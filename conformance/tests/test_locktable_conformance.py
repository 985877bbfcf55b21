"""The lock-table suite against every built-in lock table, each resolved by plugin name."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import pytest

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_api.types import Lock, LockRequest
from waltz_conformance.suites.locktable import LockTableHarness, LockTableSuite


def harness_for(name: str, options: Mapping[str, Any] | None = None) -> LockTableHarness:
    """The harness the plugin ``name`` names in its descriptor."""
    descriptor = get_registry().get(PluginKind.LOCK_TABLE, name)
    assert descriptor.conformance_harness is not None, f"{name} ships no conformance harness"
    module_name, _, attribute = descriptor.conformance_harness.partition(":")
    made = getattr(importlib.import_module(module_name), attribute)(options)
    assert isinstance(made, LockTableHarness)
    return made


class TestMemoryLockTable(LockTableSuite):
    @pytest.fixture
    def harness(self) -> LockTableHarness:
        return harness_for("memory")


class TestHwmArrayLockTable(LockTableSuite):
    @pytest.fixture
    def harness(self) -> LockTableHarness:
        return harness_for("hwm-array")


class TestTinyHwmArrayLockTable(LockTableSuite):
    """16 slots: nearly every lock collides, so the no-false-negative rule is under stress."""

    @pytest.fixture
    def harness(self) -> LockTableHarness:
        return harness_for("hwm-array", {"size": 16})


class TestOneSlotHwmArrayLockTable(LockTableSuite):
    """One slot: the degenerate table (every lock shares it) must still be safe."""

    @pytest.fixture
    def harness(self) -> LockTableHarness:
        return harness_for("hwm-array", {"size": 1})


class TestExactLockTable(LockTableSuite):
    @pytest.fixture
    def harness(self) -> LockTableHarness:
        return harness_for("exact")


def test_hwm_array_is_not_declared_exact() -> None:
    """The probabilistic table must not claim the capability its false positives break."""
    assert "exact" not in harness_for("hwm-array").capabilities
    assert "exact" in harness_for("exact").capabilities


def test_reference_descriptor_points_to_its_harness() -> None:
    descriptor = get_registry().get(PluginKind.LOCK_TABLE, "memory")
    assert descriptor.conformance_harness is not None
    module_name, _, attribute = descriptor.conformance_harness.partition(":")
    harness = getattr(importlib.import_module(module_name), attribute)()
    assert isinstance(harness, LockTableHarness)
    assert harness.name == "memory"
    assert harness.capabilities == descriptor.capabilities
    table = harness.make(3)
    assert table.estimate(LockRequest.from_locks([Lock("a", 1)])) == 3
