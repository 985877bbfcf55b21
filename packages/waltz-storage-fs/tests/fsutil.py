"""Set-up shared by the fs engine's tests (``from fsutil import ...``: conftest.py puts
this folder on the import path).

A directory of ``data/`` copied to disk or into the power-loss simulation; a new engine
with its partitions added; the acknowledged end the control file holds; a flush that
fails on demand; and the distinct crash states of a simulated run, each written to disk
in turn, with the real engine opened over one. What a ``data/`` directory holds (its
path, cluster key, records) is told by the test module of its format, which the other
tests import it from: test_format_compat.py (``format-v1``), test_format_log_start.py
(``log-start-v2``), test_format_v3.py (``format-v3``).
"""

from __future__ import annotations

import errno
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waltz_storage_fs import tools
from waltz_storage_fs.committer import Runner
from waltz_storage_fs.engine import FsStorageEngine, FsStoragePartition
from waltz_storage_fs.files import REAL_FILES, Files
from waltz_storage_fs.powerloss import PowerLossFiles, Snapshot, materialize, tree_digest


def copy_of(source: Path, tmp_path: Path) -> Path:
    """A copy of the directory ``source`` (a ``data/`` one) at ``tmp_path/storage``."""
    location = tmp_path / "storage"
    shutil.copytree(source, location)
    return location


def preloaded(base: Path, source: Path) -> PowerLossFiles:
    """Simulated files under ``base`` whose durable state holds the directory ``source``
    (a ``data/`` one) as ``base/storage``; no step recorded yet."""
    files = PowerLossFiles(base)
    files.preload(
        {
            f"storage/{p.relative_to(source)}": p.read_bytes()
            for p in sorted(source.rglob("*"))
            if p.is_file()
        }
    )
    return files


async def new_engine(
    location: Path | str,
    cluster_key: uuid.UUID,
    partitions: int,
    *,
    feature_level: int | None = None,
    options: Mapping[str, Any] | None = None,
    files: Files = REAL_FILES,
    runner: Runner | None = None,
) -> tuple[FsStorageEngine, list[FsStoragePartition]]:
    """The engine of a new directory of ``partitions`` partitions, each of them added (in
    the format of ``feature_level``); the engine and the partitions, in order."""
    engine = await FsStorageEngine.open(
        str(location),
        cluster_key=cluster_key,
        num_partitions=partitions,
        feature_level=feature_level,
        options=options,
        files=files,
        runner=runner,
    )
    return engine, [await engine.add_partition(pid) for pid in range(partitions)]


def acked_end(directory: Path, partition_id: int = 0) -> int:
    """The partition's acknowledged end, as the control file holds it now."""
    current = tools.read_control_file(directory).partitions[partition_id].current
    assert current is not None
    return current.acked_end


class FailingFlush(Files):
    """The real files; the next flush of a chosen fd fails (EIO)."""

    def __init__(self) -> None:
        self.fail: set[int] = set()

    def fdatasync(self, fd: int) -> None:
        if fd in self.fail:
            self.fail.discard(fd)
            raise OSError(errno.EIO, "a simulated failed flush")
        super().fdatasync(fd)


@dataclass(frozen=True)
class CrashState:
    """One crash state of a simulated run, written to ``directory``."""

    number: int
    """The index of its snapshot in the run's list."""
    name: str
    snapshot: Snapshot
    directory: Path

    @property
    def storage(self) -> Path:
        """The engine's directory in it (the run's ``base/storage``)."""
        return self.directory / "storage"

    @property
    def where(self) -> str:
        """The state, as a failure names it."""
        return f"step {self.snapshot.step} ({self.snapshot.operation}), state {self.name}"


class CrashStates:
    """Each crash state of ``snapshots`` (from index ``first`` on) that is not the same
    tree as one before, written to ``root/crash-<number>-<name>`` just before it is
    yielded. The caller removes a directory once it is done with it."""

    def __init__(self, snapshots: Sequence[Snapshot], root: Path, first: int = 0) -> None:
        self.snapshots = snapshots
        self.root = root
        self.first = first
        self.states = 0
        """Crash states seen so far, the same tree counted again."""
        self.distinct = 0
        """Crash states yielded so far."""

    def __iter__(self) -> Iterator[CrashState]:
        seen: set[str] = set()
        for number, snapshot in enumerate(self.snapshots[self.first :], self.first):
            for name, tree in snapshot.states():
                self.states += 1
                digest = tree_digest(tree)
                if digest in seen:
                    continue
                seen.add(digest)
                self.distinct += 1
                directory = self.root / f"crash-{number}-{name}"
                materialize(tree, directory)
                yield CrashState(number, name, snapshot, directory)


async def open_or_fail(
    crash: CrashState, failures: list[str], options: Mapping[str, Any] | None = None
) -> FsStorageEngine | None:
    """The real engine over the crash state's directory; None, with the failure added to
    ``failures``, when it does not open."""
    try:
        return await FsStorageEngine.open(str(crash.storage), options=options)
    except Exception as exc:
        failures.append(f"{crash.where}: does not open: {exc!r}")
        return None
