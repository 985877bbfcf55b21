"""waltz_conformance: the shared suite every Waltz plugin passes, and the reference plugins.

A backend author subclasses a suite and provides its harness fixture::

    from waltz_conformance.suites.locktable import LockTableSuite, LockTableHarness

    class TestMyLockTable(LockTableSuite):
        @pytest.fixture
        def harness(self) -> LockTableHarness:
            return LockTableHarness(name="mine", factory=MyLockTable, capabilities={...})

Tests of optional features are marked ``@requires("capability")`` and are
skipped, visibly and with the reason, for a backend that does not declare it.
"""

from waltz_conformance.harness import Harness, requires

__all__ = ["Harness", "requires"]
