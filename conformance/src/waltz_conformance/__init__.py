"""waltz_conformance: the shared suite every Waltz plugin passes, and the reference plugins.

A backend author subclasses a suite and provides its harness fixture::

    from waltz_conformance.suites.locktable import LockTableSuite, LockTableHarness

    class TestMyLockTable(LockTableSuite):
        @pytest.fixture
        def harness(self) -> LockTableHarness:
            return LockTableHarness(name="mine", factory=MyLockTable, capabilities={...})

Tests of optional features are marked ``@requires("capability")`` and are
skipped, visibly and with the reason, for a backend that does not declare it.

The names below are imported on first use: the plugin's entry point imports this
package, and reading its descriptor must not import the implementation.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_conformance.harness import Harness, requires

__all__ = ["Harness", "requires"]
__getattr__, __dir__ = lazy_exports(__name__, {"Harness": ".harness", "requires": ".harness"})
