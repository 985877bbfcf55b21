"""Registers the file-segment storage engine as the storage plugin ``fs``.

Light on purpose: the engine is imported only when ``fs`` is chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.capabilities import (
    AVAILABILITY,
    CRASH_REOPEN,
    FILE_FAULTS,
    PREFIX,
    REOPEN,
    REPAIR,
    SEGMENTS,
)
from waltz_api.hookspecs import StorageEngineDescriptor, hookimpl

if TYPE_CHECKING:
    from waltz_api.contracts.storage import StorageEngine

CAPABILITIES = frozenset(
    {REOPEN, CRASH_REOPEN, FILE_FAULTS, SEGMENTS, REPAIR, AVAILABILITY, PREFIX}
)


def load_engine() -> type[StorageEngine]:
    from waltz_storage_fs.engine import FsStorageEngine

    return FsStorageEngine


@hookimpl
def waltz_storage_engines() -> list[StorageEngineDescriptor]:
    return [
        StorageEngineDescriptor(
            name="fs",
            load=load_engine,
            capabilities=CAPABILITIES,
            description="segment files in a local storage directory, fdatasync'd group commit",
            uri_schemes=("file",),
            conformance_harness="waltz_storage_fs.conformance:harness",
        )
    ]
