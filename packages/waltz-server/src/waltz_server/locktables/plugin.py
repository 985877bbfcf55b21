"""Registers the built-in lock tables: ``hwm-array`` (the default) and ``exact``, and
their options.

Light on purpose: a lock table is imported only when it is chosen."""

from __future__ import annotations

from collections.abc import Sequence

from waltz_api.capabilities import BOUNDED_MEMORY, EXACT
from waltz_api.hookspecs import (
    LockTableDescriptor,
    LockTableFactory,
    OptionSchema,
    OptionSpec,
    hookimpl,
)

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


def hwm_array_options() -> Sequence[OptionSpec]:
    from waltz_api.config import same_keys
    from waltz_server.locktables import hwm_array

    same_keys("hwm-array lock table", hwm_array._OPTIONS, ["size"])
    return [
        OptionSpec(
            "size",
            "int",
            hwm_array.DEFAULT_SIZE,
            f"slots of high-water marks (1 to {hwm_array.MAX_SIZE}); more slots, fewer "
            "false lock failures, more memory (8 bytes a slot)",
        )
    ]


def exact_options() -> Sequence[OptionSpec]:
    from waltz_api.config import same_keys
    from waltz_server.locktables import exact

    same_keys("exact lock table", exact._OPTIONS, [])
    return []


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [
        OptionSchema("hwm-array-options", hwm_array_options),
        OptionSchema("exact-options", exact_options),
    ]
