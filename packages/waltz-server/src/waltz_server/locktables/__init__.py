"""The built-in lock tables (plugins ``hwm-array``, the default, and ``exact``).

The names below are imported on first use: the plugin module
(:mod:`waltz_server.locktables.plugin`) is read by every process, a lock table only
by the server that chose it."""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_server.locktables.exact import ExactLockTable
    from waltz_server.locktables.hwm_array import DEFAULT_SIZE, HwmArrayLockTable

__all__ = ["DEFAULT_SIZE", "ExactLockTable", "HwmArrayLockTable"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"ExactLockTable": ".exact", "DEFAULT_SIZE": ".hwm_array", "HwmArrayLockTable": ".hwm_array"},
)
