"""The control file ``waltz-storage.ctl``: its header and the partition info structs.

Each partition has two structs written alternately (the one that is not
current, with the next sequence number, then flushed), so a torn write leaves
the other one valid. The file is written in its own version (2 or 3: the cluster's
feature level decides, see :mod:`waltz_storage_fs.format`); a version-1 file is migrated
to version 2 when it is opened, and :meth:`ControlFile.upgrade` migrates a version-2 file
to version 3 once the level allows it. A version-4 file (a directory with a node journal)
also keeps the journal's checkpoint in two alternating slots after the partition infos
(:meth:`ControlFile.read_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path

from waltz_api.errors import CorruptionError, StorageError
from waltz_api.types import SessionInfo
from waltz_storage_fs import format as fmt
from waltz_storage_fs.files import OPEN_NEW, OPEN_WRITE, Files
from waltz_storage_fs.journal import HEADER_BLOCK

log = logging.getLogger(__name__)


def backup_suffix(version: int) -> str:
    """The suffix of the control file of an older format, kept beside the migrated one."""
    return f".v{version}"


class ControlFile:
    """The open control file of a storage directory (holding its lock)."""

    def __init__(self, path: Path, fd: int, header: fmt.ControlHeader, files: Files) -> None:
        self.path = path
        self.fd = fd
        self.header = header
        self.files = files
        self._checkpoint_slot = 0
        self._checkpoint_counter = 0

    @property
    def version(self) -> int:
        """The control file's format version (2 or 3)."""
        return self.header.version

    @property
    def keeps_acked_end(self) -> bool:
        """Whether its structs hold each partition's acknowledged end (version 3)."""
        return self.header.version >= fmt.ACKED_END_VERSION

    @property
    def keeps_journal(self) -> bool:
        """Whether the directory has a node journal whose checkpoint this file keeps."""
        return self.header.version >= fmt.JOURNAL_CONTROL_VERSION

    def read_checkpoint(self) -> fmt.Checkpoint:
        """The journal's checkpoint: the valid slot with the higher counter
        (CorruptionError when neither is valid: where to replay from is unknown)."""
        num = self.header.num_partitions
        raw = self.files.pread(self.fd, 2 * fmt.CHECKPOINT_SLOT_SIZE, fmt.checkpoint_offset(num, 0))
        slots = [fmt.decode_checkpoint(raw[i * fmt.CHECKPOINT_SLOT_SIZE :]) for i in range(2)]
        valid = [s for s in slots if s is not None]
        if not valid:
            raise CorruptionError(
                f"{self.path}: both journal checkpoint slots fail their checksum, so where "
                "the journal's replay starts is unknown; nothing was cut: repair this node "
                "from a replica (waltz storage repair)"
            )
        best = max(valid, key=lambda c: c.counter)
        self._checkpoint_slot = slots.index(best)
        self._checkpoint_counter = best.counter
        return best

    def write_checkpoint(self, position: int, sequence: int) -> None:
        """Write the checkpoint in the slot that is not current (not flushed: the caller
        flushes the file with the acknowledged ends it wrote)."""
        slot = 1 - self._checkpoint_slot
        counter = self._checkpoint_counter + 1
        self.files.pwrite(
            self.fd,
            fmt.encode_checkpoint(fmt.Checkpoint(counter, position, sequence)),
            fmt.checkpoint_offset(self.header.num_partitions, slot),
        )
        self._checkpoint_slot, self._checkpoint_counter = slot, counter

    @classmethod
    def create(
        cls,
        directory: Path,
        cluster_key: uuid.UUID,
        num_partitions: int,
        files: Files,
        version: int = fmt.FORMAT_VERSION,
    ) -> ControlFile:
        header = fmt.ControlHeader(version, files.now_ms(), cluster_key, num_partitions)
        body = (
            fmt.encode_control_header(header)
            + b"".join(fmt.initial_partition_info(p, version) for p in range(num_partitions))
            + _initial_checkpoint(version)
        )
        _write_atomically(files, directory / fmt.CONTROL_FILE_NAME, body)
        return cls.open(directory / fmt.CONTROL_FILE_NAME, files)

    @classmethod
    def open(cls, path: Path, files: Files) -> ControlFile:
        fd = files.open(path, OPEN_WRITE)
        try:
            # one engine per storage directory: a second writer would corrupt it
            files.lock(fd)
        except BlockingIOError:
            files.close(fd)
            raise StorageError(
                f"the storage directory {path.parent} is in use by another storage engine "
                "(another storage node process?); stop it first"
            ) from None
        header = fmt.decode_control_header(files.pread(fd, fmt.HEADER_SIZE, 0))
        if header is None:
            files.close(fd)
            raise CorruptionError(
                f"{path}: the control file header is short or fails its checksum; the storage "
                "directory cannot be opened (restore it, or recreate the node's storage)"
            )
        if header.version not in fmt.CONTROL_VERSIONS:
            files.close(fd)
            raise CorruptionError(
                f"{path}: control file format version {header.version} is not one this Waltz "
                f"opens ({', '.join(map(str, fmt.CONTROL_VERSIONS))}); a newer Waltz wrote it"
            )
        if header.version < fmt.FORMAT_OF_LEVEL[1]:
            # what 0.1.0 did too: a version-1 file becomes version 2 (level 1's format)
            files.close(fd)  # the lock is taken again on the migrated file
            _migrate(files, path, header, fmt.FORMAT_OF_LEVEL[1])
            return cls.open(path, files)
        control = cls(path, fd, header, files)
        if control.keeps_journal:
            try:
                control.read_checkpoint()
            except BaseException:
                files.close(fd)
                raise
        return control

    def upgrade(self, version: int) -> ControlFile:
        """Migrate this (flushed) file to ``version`` in place, keeping the old one beside
        it; returns the new file open and locked (this one is closed). Each partition's
        acknowledged end is unknown in it (the caller writes it). A crash leaves the old
        file or the new one, whole."""
        self.sync()
        _migrate(self.files, self.path, self.header, version)
        new = ControlFile.open(self.path, self.files)
        self.close()
        return new

    def read_partition(
        self, partition_id: int
    ) -> tuple[fmt.InfoStruct | None, fmt.InfoStruct | None]:
        version = self.header.version
        raw = self.files.pread(
            self.fd,
            fmt.partition_info_size(version),
            fmt.partition_info_offset(partition_id, version),
        )
        stored_id, first, second = fmt.decode_partition_info(partition_id, raw, version)
        if stored_id is not None and stored_id != partition_id:
            return None, None
        return first, second

    def write_struct(
        self, partition_id: int, slot: int, struct: fmt.InfoStruct, *, sync: bool = True
    ) -> None:
        """Write one struct; flushed unless ``sync`` is False (the committer writes the
        acknowledged ends of a group's partitions, then flushes the file once)."""
        version = self.header.version
        self.files.pwrite(
            self.fd,
            fmt.encode_info_struct(partition_id, struct, version),
            fmt.info_struct_offset(partition_id, slot, version),
        )
        if sync:
            self.files.fdatasync(self.fd)

    def sync(self) -> None:
        self.files.fdatasync(self.fd)

    def reset_partition(self, partition_id: int, assigned: bool) -> tuple[int, fmt.InfoStruct]:
        """Rewrite both structs with fresh session info (add and remove a partition).

        The slot that is not current is written first with a higher sequence
        number, so a crash in between leaves the new state winning or the old
        state intact. Returns (current slot, struct)."""
        flags = fmt.FLAG_ASSIGNED if assigned else 0
        first, second = self.read_partition(partition_id)
        current = fmt.current_struct(first, second)
        base = max((s.sequence for s in (first, second) if s is not None), default=0)
        slot = 1 - current[0] if current is not None else 0
        self.write_struct(partition_id, slot, fmt.InfoStruct(SessionInfo(), flags, base + 1))
        struct = fmt.InfoStruct(SessionInfo(), flags, base + 2)
        self.write_struct(partition_id, 1 - slot, struct)
        return 1 - slot, struct

    def close(self) -> None:
        self.files.close(self.fd)


def _initial_checkpoint(version: int) -> bytes:
    """A new version-4 file's checkpoint slots: the journal's start (nothing else)."""
    if version < fmt.JOURNAL_CONTROL_VERSION:
        return b""
    return fmt.encode_checkpoint(fmt.Checkpoint(1, HEADER_BLOCK, 0)) + fmt.encode_checkpoint(
        fmt.Checkpoint(0, HEADER_BLOCK, 0)
    )


def _write_atomically(files: Files, path: Path, body: bytes) -> None:
    """``path`` holds ``body`` or what it held before, whatever the crash."""
    tmp = path.with_name(path.name + ".tmp")
    fd = files.open(tmp, OPEN_NEW, 0o644)
    try:
        files.pwrite(fd, body, 0)
        files.fsync(fd)
    finally:
        files.close(fd)
    files.replace(tmp, path)
    files.fsync_dir(path.parent)


def _migrate(files: Files, path: Path, header: fmt.ControlHeader, version: int) -> None:
    """Rewrite an older control file in format ``version`` (each partition's current
    struct in both slots; both stay invalid where both were), keeping the old one. The
    acknowledged end is unknown (recovery sets it to the log's end at the next open)."""
    fd = files.open(path, OPEN_WRITE)
    try:
        size = fmt.partition_info_offset(header.num_partitions, header.version)
        raw = files.pread(fd, size, 0)
    finally:
        files.close(fd)
    new_header = fmt.ControlHeader(
        version, header.creation_time_ms, header.cluster_key, header.num_partitions
    )
    parts = [fmt.encode_control_header(new_header)]
    for pid in range(header.num_partitions):
        offset = fmt.partition_info_offset(pid, header.version)
        info_size = fmt.partition_info_size(header.version)
        stored, first, second = fmt.decode_partition_info(
            pid, raw[offset : offset + info_size], header.version
        )
        current = None if stored not in (None, pid) else fmt.current_struct(first, second)
        if current is None:
            parts.append(fmt.invalid_partition_info(pid, version))
            continue
        struct = dataclasses.replace(current[1], acked_end=fmt.ACKED_END_UNKNOWN)
        older = dataclasses.replace(struct, sequence=struct.sequence - 1)
        parts.append(fmt.encode_partition_info(pid, struct, older, version))
    parts.append(_initial_checkpoint(version))
    backup = path.with_name(path.name + backup_suffix(header.version))
    if not files.exists(backup):
        files.link(path, backup)
        files.fsync_dir(path.parent)
    _write_atomically(files, path, b"".join(parts))
    log.warning(
        "%s: migrated the control file from format version %d to %d (the version-%d file is "
        "kept as %s)",
        path,
        header.version,
        version,
        header.version,
        backup.name,
    )
