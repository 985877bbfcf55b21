"""Registers the built-in lock tables: ``hwm-array`` (the default) and ``exact``."""

from __future__ import annotations

from waltz_api.capabilities import BOUNDED_MEMORY, EXACT
from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl

DEFAULT_LOCK_TABLE = "hwm-array"


@hookimpl
def waltz_lock_tables() -> list[PluginDescriptor]:
    from waltz_server.locktables.exact import ExactLockTable
    from waltz_server.locktables.hwm_array import HwmArrayLockTable

    return [
        PluginDescriptor(
            kind=PluginKind.LOCK_TABLE,
            name="hwm-array",
            factory=HwmArrayLockTable,
            capabilities=frozenset({BOUNDED_MEMORY}),  # and not EXACT
            description=(
                "fixed-size array of high-water marks, 3 hash functions (the spec's table); "
                "option: size (default 30000)"
            ),
            conformance_harness="waltz_server.locktables.conformance:hwm_array",
        ),
        PluginDescriptor(
            kind=PluginKind.LOCK_TABLE,
            name="exact",
            factory=ExactLockTable,
            capabilities=frozenset({EXACT}),
            description="a dictionary of every lock's last change: no false positives, "
            "memory grows with the number of distinct locks",
            conformance_harness="waltz_server.locktables.conformance:exact",
        ),
    ]
