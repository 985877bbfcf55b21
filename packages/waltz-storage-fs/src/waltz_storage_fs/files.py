"""The file layer of the fs engine: every call the engine makes to the file system.

:class:`Files` is the real one (thin aliases of :mod:`os`, no cost on the append
path). A test injects another with the same methods, such as
:class:`waltz_storage_fs.powerloss.PowerLossFiles`, which keeps only what a
completed flush made durable and so shows what a power loss leaves behind.

The durability rules the engine relies on are POSIX's, taken pessimistically:
written bytes and a file's size are durable once ``fdatasync``/``fsync`` of that
file returned; a directory entry (create, rename, unlink) once ``fsync_dir`` of
its directory returned.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

OPEN_READ = os.O_RDONLY
OPEN_WRITE = os.O_RDWR
OPEN_CREATE = os.O_RDWR | os.O_CREAT
OPEN_NEW = os.O_RDWR | os.O_CREAT | os.O_TRUNC


class Files:
    """The real file system."""

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        """An fd (flags: the OPEN_* constants)."""
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        return os.pread(fd, n, offset)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        """Write all of ``data`` at ``offset`` (returns its length), or raise.

        ``os.pwrite`` may write fewer bytes than asked without an error, when the file
        system fills up in the middle of the write: the rest goes in another call, which
        completes it or raises (``ENOSPC``). Taking a short write for whole left a hole
        in a record the engine had acknowledged as durable (found by ``waltz chaos``
        with a full disk)."""
        written = os.pwrite(fd, data, offset)
        while written < len(data):
            more = os.pwrite(fd, data[written:], offset + written)
            if more <= 0:
                raise OSError(
                    errno.EIO, f"pwrite wrote {written} of {len(data)} bytes at offset {offset}"
                )
            written += more
        return written

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def mkdir(self, path: Path) -> None:
        """Create one directory (its parent must exist); durable after fsync_dir(parent)."""
        os.mkdir(path)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def replace(self, src: Path, dst: Path) -> None:
        """Rename ``src`` to ``dst``, replacing it (atomic; durable after fsync_dir)."""
        os.replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        os.link(src, dst)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def lock(self, fd: int) -> None:
        """An exclusive lock on an open file; BlockingIOError when another process holds it."""
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def now_ms(self) -> int:
        """The wall clock in milliseconds: the creation times written in headers, the
        quarantine's folder names (a simulated file system gives its virtual time)."""
        return time.time_ns() // 1_000_000


REAL_FILES = Files()


def remove_tree(files: Files, path: Path) -> None:
    """Delete a directory and everything in it (then fsync its parent)."""
    for name in files.listdir(path):
        child = path / name
        if files.is_dir(child):
            remove_tree(files, child)
        else:
            files.unlink(child)
    files.rmdir(path)
    files.fsync_dir(path.parent)


def make_dirs(files: Files, path: Path) -> None:
    """Create ``path`` and its missing parents, each made durable in its parent."""
    if files.is_dir(path):
        return
    make_dirs(files, path.parent)
    files.mkdir(path)
    files.fsync_dir(path.parent)


def copy_range(files: Files, src_fd: int, span: tuple[int, int], dst_fd: int, dst_at: int) -> None:
    """Copy bytes ``span = (start, end)`` of one open file into another at ``dst_at``."""
    start, end = span
    chunk = 1 << 20
    position = start
    while position < end:
        data = files.pread(src_fd, min(chunk, end - position), position)
        if not data:
            break
        files.pwrite(dst_fd, data, dst_at + position - start)
        position += len(data)
