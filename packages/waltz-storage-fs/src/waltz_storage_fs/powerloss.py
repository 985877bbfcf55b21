"""An in-memory file system that knows what a power loss would keep (for tests).

:class:`PowerLossFiles` is a :class:`~waltz_storage_fs.files.Files` holding every
file in memory. Each file remembers its *durable* content (as of the last
``fsync``/``fdatasync`` that returned) and the writes since; each directory its
durable entries (as of the last ``fsync_dir``). Every call that changes
anything is a *step*; after each one the layer can take a :class:`Snapshot`,
cheap (durable contents are immutable bytes, shared), from which
:meth:`Snapshot.states` builds what a crash at that step may leave on disk:

- ``durable``: only what completed flushes covered (a power loss);
- ``volatile``: everything written (a process kill: the page cache survives);
- ``torn-head`` / ``torn-tail``: the durable state plus every pending write but
  the last, of which only the sectors before a sector boundary in its middle,
  or only those after it, reached the disk (a torn write: sectors written out
  of order; unwritten bytes past the old end of a file read as zeros);
- ``files-only`` / ``entries-only``: file contents as written but directory
  entries as flushed, and the reverse.

:func:`materialize` writes one state into a real directory, where the real
engine then opens it.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz_storage_fs.files import Files

STATES = ("durable", "volatile", "torn-head", "torn-tail", "files-only", "entries-only")
SECTOR = 512
"""The unit a disk writes atomically: a torn write keeps some whole sectors of it."""

_Op = tuple[str, int, bytes]
"""A pending change of a file: ("write", offset, data) or ("truncate", size, b"")."""


def scratch_directory(prefix: str) -> Path | None:
    """A new directory on a tmpfs (``/dev/shm``) when there is a writable one, else
    None. For copies the real engine opens only to check what it makes of them (crash
    states, damage sweeps): their fsyncs test nothing there, and cost seconds on a busy
    disk (the power loss itself is simulated)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        return None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm))


class _Inode:
    __slots__ = ("data", "durable", "number", "pending")

    def __init__(self, number: int) -> None:
        self.number = number
        self.data = bytearray()
        self.durable = b""
        self.pending: list[_Op] = []


class _Dir:
    __slots__ = ("durable", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, _Inode | _Dir] = {}
        self.durable: dict[str, _Inode | _Dir] = {}


@dataclass(frozen=True)
class _FileState:
    durable: bytes
    pending: tuple[_Op, ...]


@dataclass(frozen=True)
class _DirState:
    entries: tuple[tuple[str, Any], ...]
    durable: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Snapshot:
    """What the layer held right after one step (see :meth:`states`)."""

    step: int
    operation: str
    root: _DirState

    def states(self) -> Iterator[tuple[str, dict[str, bytes]]]:
        """(name, tree) for each crash state: the tree maps relative paths to contents
        (a path ending in ``/`` is an empty directory)."""
        for name in STATES:
            yield name, self.state(name)

    def state(self, name: str) -> dict[str, bytes]:
        """The tree of one crash state (see :meth:`states`)."""
        files_mode = {
            "durable": "durable",
            "volatile": "volatile",
            "torn-head": "head",
            "torn-tail": "tail",
            "files-only": "volatile",
            "entries-only": "durable",
        }[name]
        entries_volatile = name in ("volatile", "entries-only")
        tree: dict[str, bytes] = {}
        _walk(self.root, "", files_mode, entries_volatile, tree)
        return tree


def _walk(
    node: _DirState, prefix: str, files_mode: str, entries_volatile: bool, tree: dict[str, bytes]
) -> None:
    entries = node.entries if entries_volatile else node.durable
    if not entries and prefix:
        tree[prefix] = b""
    for name, child in entries:
        path = prefix + name
        if isinstance(child, _DirState):
            _walk(child, path + "/", files_mode, entries_volatile, tree)
        else:
            tree[path] = _content(child, files_mode)


def _content(state: _FileState, mode: str) -> bytes:
    data = bytearray(state.durable)
    ops = state.pending
    if mode == "durable" or not ops:
        return bytes(data)
    for op in ops[:-1] if mode in ("head", "tail") else ops:
        _apply(data, op, "full")
    if mode in ("head", "tail"):
        _apply(data, ops[-1], mode)
    return bytes(data)


def _apply(data: bytearray, op: _Op, part: str) -> None:
    kind, at, payload = op
    if kind == "truncate":
        if part != "tail":  # a torn truncate: the size may or may not have changed
            del data[at:]
            data.extend(bytes(max(0, at - len(data))))
        return
    if part in ("head", "tail"):
        # a write is torn at a sector boundary: a disk writes whole sectors, in any order
        boundaries = range(-(-(at + 1) // SECTOR) * SECTOR, at + len(payload), SECTOR)
        split = boundaries[len(boundaries) // 2] - at if boundaries else len(payload)
        if part == "head":
            payload = payload[:split]
        else:
            old = bytes(data[at : at + split])
            payload = old + bytes(split - len(old)) + payload[split:]
    end = at + len(payload)
    if len(data) < end:
        data.extend(bytes(end - len(data)))
    data[at:end] = payload


def tree_digest(tree: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for path in sorted(tree):
        digest.update(path.encode() + b"\0" + hashlib.sha256(tree[path]).digest())
    return digest.hexdigest()


def materialize(tree: dict[str, bytes], directory: Path) -> None:
    """Write a crash state into ``directory`` (which must not exist yet)."""
    directory.mkdir(parents=True)
    for path, content in sorted(tree.items()):
        target = directory / path
        if path.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


@dataclass
class PowerLossFiles(Files):
    """The file layer over an in-memory tree rooted at ``base`` (see the module)."""

    base: Path
    on_step: Callable[[Snapshot], None] | None = None
    """Called with a snapshot after every step (from the thread that made the step)."""
    step: int = 0
    _root: _Dir = field(default_factory=_Dir)
    _fds: dict[int, _Inode] = field(default_factory=dict)
    _next_fd: Iterator[int] = field(default_factory=lambda: itertools.count(1000))
    _inodes: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # -- paths ----------------------------------------------------------------------------

    def _parts(self, path: Path | str) -> list[str]:
        relative = Path(path).relative_to(self.base)
        return [p for p in relative.parts if p not in ("", ".")]

    def _lookup(self, path: Path | str) -> _Inode | _Dir | None:
        node: _Inode | _Dir = self._root
        for part in self._parts(path):
            if not isinstance(node, _Dir) or part not in node.entries:
                return None
            node = node.entries[part]
        return node

    def _parent(self, path: Path | str) -> tuple[_Dir, str]:
        parts = self._parts(path)
        if not parts:
            raise PermissionError(f"{path}: the root of the simulated file system")
        parent = self._lookup(Path(self.base, *parts[:-1]))
        if not isinstance(parent, _Dir):
            raise FileNotFoundError(f"{path}: no such directory {Path(path).parent}")
        return parent, parts[-1]

    def _dir(self, path: Path | str) -> _Dir:
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            raise NotADirectoryError(f"{path}: not a directory")
        return node

    def _inode(self, fd: int) -> _Inode:
        try:
            return self._fds[fd]
        except KeyError:
            raise OSError(9, f"bad file descriptor {fd}") from None

    # -- steps -------------------------------------------------------------------------------

    def _stepped(self, operation: str) -> None:
        self.step += 1
        if self.on_step is not None:
            self.on_step(Snapshot(self.step, operation, _freeze(self._root)))

    def preload(self, tree: dict[str, bytes]) -> None:
        """Start from a durable tree (as :func:`materialize` takes it); not a step."""
        with self._lock:
            for path, content in sorted(tree.items()):
                parts = path.rstrip("/").split("/")
                node = self._root
                for part in parts[:-1] if not path.endswith("/") else parts:
                    child = node.entries.get(part)
                    if child is None:
                        child = _Dir()
                        node.entries[part] = node.durable[part] = child
                    assert isinstance(child, _Dir)
                    node = child
                if not path.endswith("/"):
                    inode = _Inode(next(self._inodes))
                    inode.data = bytearray(content)
                    inode.durable = content
                    node.entries[parts[-1]] = node.durable[parts[-1]] = inode

    # -- the Files interface -------------------------------------------------------------------

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        with self._lock:
            node = self._lookup(path)
            if isinstance(node, _Dir):
                raise IsADirectoryError(f"{path}: is a directory")
            changed = False
            if node is None:
                if not flags & os.O_CREAT:
                    raise FileNotFoundError(f"{path}: no such file")
                parent, name = self._parent(path)
                node = _Inode(next(self._inodes))
                parent.entries[name] = node
                changed = True
            if flags & os.O_TRUNC and node.data:
                node.data = bytearray()
                node.pending.append(("truncate", 0, b""))
                changed = True
            fd = next(self._next_fd)
            self._fds[fd] = node
            if changed:
                self._stepped(f"open {path}")
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._inode(fd)
            del self._fds[fd]

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        with self._lock:
            return bytes(self._inode(fd).data[offset : offset + n])

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        with self._lock:
            inode = self._inode(fd)
            payload = bytes(data)
            _apply(inode.data, ("write", offset, payload), "full")
            inode.pending.append(("write", offset, payload))
            self._stepped(f"pwrite {len(payload)} bytes at {offset} (inode {inode.number})")
            return len(payload)

    def ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            inode = self._inode(fd)
            _apply(inode.data, ("truncate", size, b""), "full")
            inode.pending.append(("truncate", size, b""))
            self._stepped(f"ftruncate to {size} (inode {inode.number})")

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            inode = self._inode(fd)
            inode.durable = bytes(inode.data)
            inode.pending = []
            self._stepped(f"fdatasync (inode {inode.number})")

    def fsync(self, fd: int) -> None:
        self.fdatasync(fd)

    def size(self, fd: int) -> int:
        with self._lock:
            return len(self._inode(fd).data)

    def listdir(self, path: Path) -> list[str]:
        with self._lock:
            return sorted(self._dir(path).entries)

    def exists(self, path: Path) -> bool:
        with self._lock:
            return self._lookup(path) is not None

    def is_dir(self, path: Path) -> bool:
        with self._lock:
            return isinstance(self._lookup(path), _Dir)

    def mkdir(self, path: Path) -> None:
        with self._lock:
            parent, name = self._parent(path)
            if name in parent.entries:
                raise FileExistsError(f"{path}: exists")
            parent.entries[name] = _Dir()
            self._stepped(f"mkdir {path}")

    def rmdir(self, path: Path) -> None:
        with self._lock:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if not isinstance(node, _Dir):
                raise NotADirectoryError(f"{path}: not a directory")
            if node.entries:
                raise OSError(39, f"{path}: directory not empty")
            del parent.entries[name]
            self._stepped(f"rmdir {path}")

    def unlink(self, path: Path) -> None:
        with self._lock:
            parent, name = self._parent(path)
            if not isinstance(parent.entries.get(name), _Inode):
                raise FileNotFoundError(f"{path}: no such file")
            del parent.entries[name]
            self._stepped(f"unlink {path}")

    def replace(self, src: Path, dst: Path) -> None:
        with self._lock:
            src_parent, src_name = self._parent(src)
            dst_parent, dst_name = self._parent(dst)
            if src_name not in src_parent.entries:
                raise FileNotFoundError(f"{src}: no such file")
            node = src_parent.entries.pop(src_name)
            dst_parent.entries[dst_name] = node
            self._stepped(f"rename {src} -> {dst}")

    def link(self, src: Path, dst: Path) -> None:
        with self._lock:
            node = self._lookup(src)
            if not isinstance(node, _Inode):
                raise FileNotFoundError(f"{src}: no such file")
            parent, name = self._parent(dst)
            if name in parent.entries:
                raise FileExistsError(f"{dst}: exists")
            parent.entries[name] = node
            self._stepped(f"link {src} -> {dst}")

    def fsync_dir(self, path: Path) -> None:
        with self._lock:
            node = self._dir(path)
            node.durable = dict(node.entries)
            self._stepped(f"fsync_dir {path}")

    def lock(self, fd: int) -> None:
        self._inode(fd)

    def snapshot(self, operation: str = "now") -> Snapshot:
        with self._lock:
            return Snapshot(self.step, operation, _freeze(self._root))

    # -- faults (a simulation's) ---------------------------------------------------------------

    def lose_power(self, state: str) -> int:
        """A power loss now: from here on the file system is crash state ``state`` (one of
        :data:`STATES`), all of it durable; every fd is void. Returns how many writes and
        truncations no flush covered (lost, or kept only in part, or kept by chance)."""
        with self._lock:
            pending = sum(len(inode.pending) for inode in _inodes(self._root))
            tree = self.snapshot("power loss").state(state)
            self._root = _Dir()
            self._fds.clear()
            self.preload(tree)
            return pending

    def drop_unflushed(self, fd: int) -> None:
        """The writes to ``fd``'s file that no flush covered are gone (the page cache
        dropped them after a failed writeback): it reads back as of its last flush."""
        with self._lock:
            inode = self._inode(fd)
            inode.data = bytearray(inode.durable)
            inode.pending = []

    def corrupt(self, path: Path, offset: int, mask: int = 0x80) -> None:
        """Flip the bits ``mask`` of the byte at ``offset`` of a file, on the medium (what
        is written and what is durable): damage, as a read would find it."""
        with self._lock:
            inode = self._lookup(path)
            if not isinstance(inode, _Inode) or offset >= len(inode.data):
                raise ValueError(f"{path}: no byte at offset {offset} to damage")
            inode.data[offset] ^= mask
            if offset < len(inode.durable):
                durable = bytearray(inode.durable)
                durable[offset] ^= mask
                inode.durable = bytes(durable)


def _inodes(node: _Dir) -> Iterator[_Inode]:
    """Every file reachable from ``node`` (a file linked twice: once per name)."""
    for child in node.entries.values():
        if isinstance(child, _Dir):
            yield from _inodes(child)
        else:
            yield child


def _freeze(node: _Dir) -> _DirState:
    def one(child: _Inode | _Dir) -> Any:
        if isinstance(child, _Dir):
            return _freeze(child)
        return _FileState(child.durable, tuple(child.pending))

    return _DirState(
        tuple((name, one(child)) for name, child in sorted(node.entries.items())),
        tuple((name, one(child)) for name, child in sorted(node.durable.items())),
    )
