"""Registers the built-in lock tables: ``hwm-array`` (the default) and ``exact``.

Light on purpose: a lock table is imported only when it is chosen."""

from __future__ import annotations

from waltz_api.capabilities import BOUNDED_MEMORY, EXACT
from waltz_api.hookspecs import LockTableDescriptor, LockTableFactory, hookimpl

DEFAULT_LOCK_TABLE = "hwm-array"


def load_hwm_array() -> LockTableFactory:
    from waltz_server.locktables.hwm_array import HwmArrayLockTable

    return HwmArrayLockTable


def load_exact() -> LockTableFactory:
    from waltz_server.locktables.exact import ExactLockTable

    return ExactLockTable


@hookimpl
def waltz_lock_tables() -> list[LockTableDescriptor]:
    return [
        LockTableDescriptor(
            name="hwm-array",
            load=load_hwm_array,
            capabilities=frozenset({BOUNDED_MEMORY}),  # and not EXACT
            description=(
                "fixed-size array of high-water marks, 3 hash functions (the spec's table); "
                "option: size (default 30000)"
            ),
            conformance_harness="waltz_server.locktables.conformance:hwm_array",
        ),
        LockTableDescriptor(
            name="exact",
            load=load_exact,
            capabilities=frozenset({EXACT}),
            description="a dictionary of every lock's last change: no false positives, "
            "memory grows with the number of distinct locks",
            conformance_harness="waltz_server.locktables.conformance:exact",
        ),
    ]
