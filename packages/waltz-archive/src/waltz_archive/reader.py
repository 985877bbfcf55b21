"""Reading archived records of one partition: what a server serves below its replicas.

:class:`ArchiveReader` finds the range holding an id in the manifest, reads the row
group holding it (its ids and every data checksum checked) and keeps recent row groups
in a cache bounded in bytes, so a client's feed that reads the history in order reads
each row group once. Blocking: the server runs it in a thread.
"""

from __future__ import annotations

import collections
import logging
import threading

import pyarrow as pa

from waltz_api.errors import ArchiveError
from waltz_api.types import Record
from waltz_archive.manifest import ArchivedRange, Manifest
from waltz_archive.objects import RangeFile
from waltz_archive.records import batch_to_records
from waltz_archive.store import ArchiveStore

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
_OPEN_FILES = 8


class ArchiveReader:
    """Archived records of one partition, through a bounded cache (thread-safe)."""

    def __init__(
        self,
        store: ArchiveStore,
        partition_id: int,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.store = store
        self.partition_id = partition_id
        self.cache_bytes = cache_bytes
        self.manifest = Manifest(partition_id)
        self._lock = threading.Lock()
        self._groups: collections.OrderedDict[tuple[str, int], pa.Table] = collections.OrderedDict()
        self._cached = 0
        self._files: collections.OrderedDict[str, RangeFile] = collections.OrderedDict()
        self.reads = 0
        self.cache_hits = 0

    @property
    def mark(self) -> int:
        return self.manifest.mark

    @property
    def cached_bytes(self) -> int:
        """Bytes of the row groups held in the cache: at most ``cache_bytes``, or one
        row group when a single one is larger."""
        return self._cached

    def set_manifest(self, manifest: Manifest) -> None:
        """A newer manifest (the mark moved): ranges only ever get added."""
        if manifest.partition_id != self.partition_id:
            raise ArchiveError(
                f"manifest of partition {manifest.partition_id} given to partition "
                f"{self.partition_id}'s reader"
            )
        with self._lock:
            if manifest.mark >= self.manifest.mark:
                self.manifest = manifest

    def read(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        """Consecutive archived records from ``start`` (at most ``max_records``, about
        ``max_bytes`` of data, at least one), not past one row group; empty when
        ``start`` is not archived. Raises ArchiveError (naming the range and the object)
        when the archive cannot be read or an object fails its checks."""
        manifest = self.manifest
        archived = manifest.find(start)
        if archived is None or max_records <= 0:
            return []
        table, group_first = self._row_group(archived, start)
        offset = start - group_first
        count = min(max_records, table.num_rows - offset)
        rows = table.slice(offset, count)
        records = batch_to_records(rows)
        if len(records) > 1 and max_bytes > 0:
            total = 0
            for i, record in enumerate(records):
                total += len(record.data)
                if total > max_bytes and i > 0:
                    return records[:i]
        return records

    def _row_group(self, archived: ArchivedRange, transaction_id: int) -> tuple[pa.Table, int]:
        self.reads += 1
        with self._lock:
            reader = self._file(archived)
            index = reader.row_group_of(transaction_id)
            group_first = reader.row_starts[index]
            key = (archived.name, index)
            table = self._groups.get(key)
            if table is not None:
                self._groups.move_to_end(key)
                self.cache_hits += 1
                return table, group_first
        table = reader.read_row_group(index)  # outside the lock: the slow part
        with self._lock:
            if key not in self._groups:
                self._groups[key] = table
                self._cached += table.nbytes
                while self._cached > self.cache_bytes and len(self._groups) > 1:
                    _, dropped = self._groups.popitem(last=False)
                    self._cached -= dropped.nbytes
        return table, group_first

    def _file(self, archived: ArchivedRange) -> RangeFile:
        reader = self._files.get(archived.name)
        if reader is not None:
            self._files.move_to_end(archived.name)
            return reader
        reader = RangeFile(self.store, self.partition_id, archived)
        try:
            reader.check_footer()
        except ArchiveError:
            reader.close()
            raise
        self._files[archived.name] = reader
        while len(self._files) > _OPEN_FILES:
            _, closed = self._files.popitem(last=False)
            closed.close()
        return reader

    def close(self) -> None:
        with self._lock:
            for reader in self._files.values():
                reader.close()
            self._files.clear()
            self._groups.clear()
            self._cached = 0
