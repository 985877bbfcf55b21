"""The quarantine: where recovery puts what it cannot read, instead of deleting it.

``<storage dir>/quarantine/<partition>/<UTC time>-<reason>/``: one folder per
action, holding the files moved there whole or the bytes copied there
(``<segment name>@<offset>``), and a ``README.txt`` saying what came from where
and why. Nothing reads them back: they are for an operator (``waltz storage
verify`` lists them), who deletes them once no longer needed.
"""

from __future__ import annotations

import time
from pathlib import Path

from waltz_storage_fs import format as fmt
from waltz_storage_fs.files import OPEN_NEW, Files, copy_range, make_dirs


class Quarantine:
    """``<storage dir>/quarantine/<partition>/``: where recovery moves what it cannot read."""

    def __init__(self, files: Files, storage_directory: Path, partition_id: int) -> None:
        self.files = files
        self.root = storage_directory / fmt.QUARANTINE_DIR_NAME / str(partition_id)
        self.partition_id = partition_id
        self.folders: list[Path] = []

    def folder(self, reason: str, readme: str) -> Path:
        """A new folder for one action (durable), with its README."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.files.now_ms() // 1000))
        make_dirs(self.files, self.root)
        name = f"{stamp}-{reason}"
        path = self.root / name
        n = 1
        while self.files.exists(path):
            n += 1
            path = self.root / f"{name}-{n}"
        self.files.mkdir(path)
        self.files.fsync_dir(self.root)
        self._write(path / "README.txt", readme.encode() + b"\n")
        self.folders.append(path)
        return path

    def move(self, folder: Path, *paths: Path) -> None:
        """Move files (of the partition directory) into ``folder``, durably."""
        for path in paths:
            self.files.replace(path, folder / path.name)
        self.files.fsync_dir(folder)
        if paths:
            self.files.fsync_dir(paths[0].parent)

    def save(self, folder: Path, name: str, src_fd: int, start: int, end: int) -> None:
        """Copy bytes ``start..end`` of an open file into ``folder/name``, durably."""
        fd = self.files.open(folder / name, OPEN_NEW, 0o644)
        try:
            copy_range(self.files, src_fd, (start, end), fd, 0)
            self.files.fsync(fd)
        finally:
            self.files.close(fd)
        self.files.fsync_dir(folder)

    def _write(self, path: Path, data: bytes) -> None:
        fd = self.files.open(path, OPEN_NEW, 0o644)
        try:
            self.files.pwrite(fd, data, 0)
            self.files.fsync(fd)
        finally:
            self.files.close(fd)
