"""Registers the file-segment storage engine as the storage plugin ``fs``."""

from __future__ import annotations

from waltz_api.capabilities import (
    AVAILABILITY,
    CRASH_REOPEN,
    FILE_FAULTS,
    REOPEN,
    REPAIR,
    SEGMENTS,
)
from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl

CAPABILITIES = frozenset({REOPEN, CRASH_REOPEN, FILE_FAULTS, SEGMENTS, REPAIR, AVAILABILITY})


@hookimpl
def waltz_storage_engines() -> list[PluginDescriptor]:
    from waltz_storage_fs.engine import FsStorageEngine

    return [
        PluginDescriptor(
            kind=PluginKind.STORAGE,
            name="fs",
            factory=FsStorageEngine,
            capabilities=CAPABILITIES,
            description="segment files in a local storage directory, fdatasync'd group commit",
            uri_schemes=("file",),
            conformance_harness="waltz_storage_fs.conformance:harness",
        )
    ]
