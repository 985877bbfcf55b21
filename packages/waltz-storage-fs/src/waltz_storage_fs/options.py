"""The fs engine's options (the ``options`` mapping of its ``open``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from waltz_api.errors import StorageError
from waltz_storage_fs import format as fmt

DEFAULT_SEGMENT_SIZE = 1 << 30
DEFAULT_INDEX_CHECKPOINT = 1000
DEFAULT_READ_THREADS = 2
DEFAULT_JOURNAL_SIZE = 32 << 20
DEFAULT_CHECKPOINT_BYTES = 4 << 20


@dataclass(frozen=True)
class FsOptions:
    """Engine options (``options`` mapping of :meth:`FsStorageEngine.open`)."""

    segment_size: int = DEFAULT_SEGMENT_SIZE
    """A new segment starts once the current data file reaches this many bytes."""
    index_checkpoint_interval: int = DEFAULT_INDEX_CHECKPOINT
    """The index file is flushed every this many records (the spec's 1000)."""
    read_threads: int = DEFAULT_READ_THREADS
    verify_on_open: int = 0
    """1: recovery checks every record (ignores what the indexes vouch for), so damage
    anywhere becomes a hole to repair at this start; 0 (default): only the records after
    each index's last flushed checkpoint, the rest when it is read."""
    journal_size: int = DEFAULT_JOURNAL_SIZE
    """The node journal's body in bytes (a multiple of 512; format 4, feature level 3),
    preallocated when it is created (an existing journal keeps its size)."""
    checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES
    """A journal checkpoint (the segment files flushed) after this many bytes of journal
    (or when the journal has no room for the next round)."""

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> FsOptions:
        options = dict(options or {})
        known = {
            "segment_size",
            "index_checkpoint_interval",
            "read_threads",
            "verify_on_open",
            "journal_size",
            "checkpoint_bytes",
        }
        unknown = sorted(set(options) - known)
        if unknown:
            raise StorageError(
                f"unknown fs storage option(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(known))}"
            )
        values: dict[str, int] = {}
        for key, value in options.items():
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise StorageError(f"fs storage option {key} must be an integer, not {value!r}")
            try:
                values[key] = int(value)
            except ValueError:
                raise StorageError(
                    f"fs storage option {key} must be an integer, not {value!r}"
                ) from None
        result = cls(**values)
        if result.segment_size < fmt.HEADER_SIZE + fmt.RECORD_OVERHEAD:
            raise StorageError(f"segment_size {result.segment_size} is too small (min 168)")
        if result.index_checkpoint_interval < 1 or result.read_threads < 1:
            raise StorageError("index_checkpoint_interval and read_threads must be >= 1")
        if result.verify_on_open not in (0, 1):
            raise StorageError(f"verify_on_open must be 0 or 1, not {result.verify_on_open}")
        if result.journal_size < 4096 or result.journal_size % 512:
            raise StorageError(
                f"journal_size {result.journal_size}: a multiple of 512, at least 4096"
            )
        if result.checkpoint_bytes < 1:
            raise StorageError(f"checkpoint_bytes must be >= 1, not {result.checkpoint_bytes}")
        return result
