"""The built-in lock tables (plugins ``hwm-array``, the default, and ``exact``)."""

from waltz_server.locktables.exact import ExactLockTable
from waltz_server.locktables.hwm_array import DEFAULT_SIZE, HwmArrayLockTable

__all__ = ["DEFAULT_SIZE", "ExactLockTable", "HwmArrayLockTable"]
