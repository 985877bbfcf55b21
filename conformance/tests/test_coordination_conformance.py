"""The coordination conformance suite against every first-party plugin (real servers)."""

from __future__ import annotations

import pytest

from waltz_conformance.reference.coordination import MemoryCoordinationHarness
from waltz_conformance.suites.coordination import CoordinationHarness, CoordinationSuite


class TestMemoryCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self) -> CoordinationHarness:
        return MemoryCoordinationHarness(name="memory", session_timeout=2.0)
