"""What a partition and the node journal ask of the engine that holds them, as
Protocols: :class:`~waltz_storage_fs.engine.FsStorageEngine` is each, and neither
:mod:`waltz_storage_fs.partition` nor :mod:`waltz_storage_fs.journaled` imports it (the
engine imports them: one direction, no import circle, not even for the type checker)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

from waltz_storage_fs.committer import Committer
from waltz_storage_fs.control import ControlFile
from waltz_storage_fs.files import Files
from waltz_storage_fs.journal import Journal
from waltz_storage_fs.options import FsOptions

_T = TypeVar("_T")


class EngineFiles(Protocol):
    """The engine's directory, files, control file and options, and its journal."""

    directory: Path
    control: ControlFile
    options: FsOptions
    files: Files
    journal: Journal | None

    @property
    def cluster_key(self) -> uuid.UUID: ...


class PartitionHost(EngineFiles, Protocol):
    """What a partition (:class:`~waltz_storage_fs.partition.FsStoragePartition`) asks of
    its engine: its files, and its committer and reader threads."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def committer(self) -> Committer: ...

    async def run_committed(self, action: Callable[[], None]) -> None: ...

    async def run_read(self, fn: Callable[[], _T]) -> _T: ...


class JournalPartition(Protocol):
    """What the journal's replay and checkpoint ask of a partition."""

    broken: OSError | None

    @property
    def next_txid(self) -> int: ...

    def write_records(
        self, first: int, blob: bytes, lengths: list[int], flushes: set[tuple[int, int]]
    ) -> None: ...

    def replayed(self) -> None: ...

    def flush_dirty(self) -> None: ...

    def checkpoint_end(self) -> None: ...

    def mark_broken(self, exc: OSError) -> None: ...


class JournalHost(EngineFiles, Protocol):
    """What the node journal's open, replay and checkpoint
    (:mod:`waltz_storage_fs.journaled`) ask of the engine."""

    journal_failed: OSError | None

    def hosted(self) -> Mapping[int, JournalPartition]: ...
