"""The conformance harness of the ``fs`` engine (needs ``waltz-conformance`` installed).

It knows the on-disk layout, so the suite can cut, flip and tear real files.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waltz_conformance.suites.storage import StorageHarness
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.journal import JOURNAL_FILE_NAME
from waltz_storage_fs.plugin import CAPABILITIES
from waltz_storage_fs.powerloss import scratch_directory

JOURNAL_SIZE = 1024 * 1024
"""The node journal's size in the harness (the engine's default is 32 MiB): small for the
damage sweep, above the suite's largest round (a 300 KB record; a round larger than the
journal is refused)."""


@dataclass
class FsStorageHarness(StorageHarness):
    def record_extent(
        self, location: str, partition_id: int, transaction_id: int
    ) -> tuple[Path, int, int]:
        return tools.find_record(location, partition_id, transaction_id)

    def index_files(self, location: str, partition_id: int) -> list[Path]:
        directory = Path(location) / str(partition_id)
        return [
            directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
            for first in tools.segment_firsts(directory)
        ]

    def data_files(self, location: str, partition_id: int) -> list[Path]:
        directory = Path(location) / str(partition_id)
        return [
            directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
            for first in tools.segment_firsts(directory)
        ]

    def metadata_files(self, location: str) -> list[Path]:
        """The control file, and the node journal at format 4 (feature level 3): damage
        to it refuses the open with every file as it was, or tears its last round."""
        found = [Path(location) / fmt.CONTROL_FILE_NAME]
        journal = Path(location) / JOURNAL_FILE_NAME
        return [*found, journal] if journal.exists() else found

    def stray_names(self, location: str, partition_id: int) -> list[Path]:
        directory = Path(location) / str(partition_id)
        firsts = tools.segment_firsts(directory)
        taken = set(firsts)
        last = firsts[-1] if firsts else 0
        candidates = {1, 2, last + 1, last + 1000, 10**12}
        for a, b in itertools.pairwise(firsts):
            candidates.add((a + b) // 2)
        return [
            directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
            for first in sorted(candidates - taken)
        ]

    def tear_session_info(self, location: str, partition_id: int, which: str) -> None:
        dump = tools.read_control_file(location)
        info = dump.partitions[partition_id]
        if which == "newest":
            assert info.current_slot is not None
            slots = [info.current_slot]
        elif which == "both":
            slots = [0, 1]
        else:
            raise ValueError(f"which must be 'newest' or 'both', not {which!r}")
        fd = os.open(dump.path, os.O_RDWR)
        try:
            for slot in slots:
                # a torn write: the struct's second half never reached the disk
                offset = fmt.info_struct_offset(partition_id, slot) + fmt.INFO_STRUCT_SIZE // 2
                os.pwrite(fd, bytes(fmt.INFO_STRUCT_SIZE // 2), offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def scratch(self) -> FsStorageHarness:
        """The sweep's copies on a tmpfs when there is one (its fsyncs cost nothing)."""
        made = scratch_directory("waltz-sweep-")
        return self if made is None else dataclasses.replace(self, root=made)

    def segment_count(self, location: str, partition_id: int) -> int:
        return len(tools.segment_firsts(Path(location) / str(partition_id)))


def harness(
    options: Mapping[str, Any] | None = None, root: str | os.PathLike[str] | None = None
) -> FsStorageHarness:
    """The harness over real files (real fsync) under ``root`` (default: a new temp dir).

    The node journal is small (:data:`JOURNAL_SIZE`, unless ``options`` names one): the
    damage sweep copies and scans it for every variant."""
    return FsStorageHarness(
        name="fs",
        capabilities=CAPABILITIES,
        engine_class=FsStorageEngine,
        root=Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="waltz-fs-")),
        options={"journal_size": JOURNAL_SIZE, **(options or {})},
        engine_ref="waltz_storage_fs.engine:FsStorageEngine",
    )
