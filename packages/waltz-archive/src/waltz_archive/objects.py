"""Range objects: writing one (spooled), reading it back whole (verification), reading a
row group (the server's reads).

The footer's key-value metadata (``waltz.*``) says what the object holds, and (objects
written since the identity was added) who wrote it: the cluster key and the archive
incarnation (:class:`ArchiveIdentity`). Verification checks the rows against the footer
and against what the writer read from the log. Every call is blocking (run it in a
thread).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from waltz_api.errors import ArchiveError
from waltz_archive import layout
from waltz_archive.manifest import ArchivedRange
from waltz_archive.records import SCHEMA, Digest, Fingerprint, check_rows
from waltz_archive.store import ArchiveStore

log = logging.getLogger(__name__)

OBJECT_FORMAT = 1
"""Objects that carry an identity are still format 1: the identity is two footer keys
that a reader of format 1 ignores (docs/archive.md, "Incarnations")."""
_KEYS = (
    "partition",
    "first",
    "last",
    "records",
    "digest",
    "data_bytes",
    "format",
    "cluster_key",
    "incarnation",
)


def _key(name: str) -> bytes:
    return f"waltz.{name}".encode()


@dataclass(frozen=True, slots=True)
class ArchiveIdentity:
    """Who wrote an archived object: the cluster (its key) and the archive incarnation
    of the partition's log (``ArchiveMark.incarnation``: "" until the partition is
    restored from an archive, a new token at each restore)."""

    cluster_key: str
    incarnation: str = ""

    def __str__(self) -> str:
        return f"cluster {self.cluster_key}, incarnation {self.incarnation or '(first)'}"


@dataclass(frozen=True)
class WriteOptions:
    row_group_bytes: int = 8 * 1024 * 1024
    """Data bytes per row group (a reader of a few ids reads one row group)."""
    compression: str = "zstd"
    spool_dir: str | None = None
    """Where a range for a remote archive is written before it is uploaded (default: the
    system's temporary directory)."""


class RangeWriter:
    """One range object being written: batches in id order, then :meth:`finish`.

    For a remote archive the object is written to a local spool file and uploaded whole
    by :meth:`finish` (memory stays at about one row group); for a local directory it is
    written beside its final name and renamed there, flushed. The object's name is new
    (a random token): nothing is overwritten."""

    def __init__(
        self,
        store: ArchiveStore,
        partition_id: int,
        first: int,
        options: WriteOptions,
        identity: ArchiveIdentity | None = None,
    ) -> None:
        self.store = store
        self.partition_id = partition_id
        self.identity = identity
        self.first = first
        self.next_id = first
        self.options = options
        self.digest = Digest()
        self.data_bytes = 0
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._token = store.new_token()
        fd, self._spool = tempfile.mkstemp(
            prefix=f"waltz-archive-p{partition_id}-", suffix=".parquet", dir=options.spool_dir
        )
        os.close(fd)
        self._writer = pq.ParquetWriter(
            self._spool,
            SCHEMA,
            compression=options.compression,
            use_dictionary=["client_id", "generation", "req_partition"],
            write_page_checksum=True,
        )
        self._closed = False

    @property
    def records(self) -> int:
        return self.next_id - self.first

    def add(self, batch: pa.RecordBatch, heads: bytes) -> None:
        """Rows continuing the range (checked), and their digest heads."""
        if batch.num_rows == 0:
            return
        check_rows(batch, self.next_id, f"archiving partition {self.partition_id}", False)
        self.digest.add_heads(heads, batch.num_rows)
        self.next_id += batch.num_rows
        size = batch.column("data").nbytes
        self.data_bytes += size
        self._pending.append(batch)
        self._pending_bytes += size
        if self._pending_bytes >= self.options.row_group_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            table = pa.Table.from_batches(self._pending, SCHEMA)
            self._writer.write_table(table, row_group_size=table.num_rows)
            self._pending, self._pending_bytes = [], 0

    def finish(self) -> tuple[ArchivedRange, str]:
        """Close and upload the object; returns the range (not yet verified) and the
        object's path."""
        if self.records == 0:
            raise ArchiveError(f"partition {self.partition_id}: an empty range is not archived")
        last = self.next_id - 1
        self._flush()
        footer = {
            "waltz.partition": str(self.partition_id),
            "waltz.first": str(self.first),
            "waltz.last": str(last),
            "waltz.records": str(self.records),
            "waltz.digest": str(self.digest.value),
            "waltz.data_bytes": str(self.data_bytes),
            "waltz.format": str(OBJECT_FORMAT),
        }
        if self.identity is not None:
            footer["waltz.cluster_key"] = self.identity.cluster_key
            footer["waltz.incarnation"] = self.identity.incarnation
        self._writer.add_key_value_metadata(footer)
        self._writer.close()
        self._closed = True
        name = layout.RangeName(self.first, last, self._token).name
        path = self.store.path(layout.partition_dir(self.partition_id), name)
        try:
            size = os.path.getsize(self._spool)
            self.store.put_file(self._spool, path)
        finally:
            self.discard()
        archived = ArchivedRange(self.first, last, name, size, self.data_bytes, self.digest.value)
        return archived, path

    def discard(self) -> None:
        if not self._closed:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self._spool)


def object_path(store: ArchiveStore, partition_id: int, name: str) -> str:
    return store.path(layout.partition_dir(partition_id), name)


def describe(store: ArchiveStore, partition_id: int, archived: ArchivedRange) -> str:
    """How errors name a range: partition, ids and object."""
    return (
        f"partition {partition_id}, archived range {archived.first}..{archived.last} "
        f"(object {store.where(object_path(store, partition_id, archived.name))})"
    )


class RangeFile:
    """An open range object: its footer, row groups and rows (blocking reads)."""

    def __init__(self, store: ArchiveStore, partition_id: int, archived: ArchivedRange) -> None:
        self.store = store
        self.partition_id = partition_id
        self.archived = archived
        self.where = describe(store, partition_id, archived)
        self._lock = threading.Lock()  # one reader of the handle at a time
        path = object_path(store, partition_id, archived.name)
        self._handle = store.open(path)
        try:
            self.file = pq.ParquetFile(self._handle, page_checksum_verification=True)
            meta = self.file.metadata
            footer = {
                k.decode(errors="replace"): v.decode(errors="replace")
                for k, v in (meta.metadata or {}).items()
            }
            self.footer = {name: footer.get(f"waltz.{name}") for name in _KEYS}
            self.row_starts: list[int] = []
            at = archived.first
            for i in range(meta.num_row_groups):
                self.row_starts.append(at)
                at += meta.row_group(i).num_rows
            self.rows = at - archived.first
        except ArchiveError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise ArchiveError(f"{self.where}: cannot read the Parquet object: {exc}") from exc

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._handle.close()

    @property
    def identity(self) -> ArchiveIdentity | None:
        """Who wrote the object (None: written before objects carried an identity)."""
        cluster_key = self.footer.get("cluster_key")
        if cluster_key is None:
            return None
        return ArchiveIdentity(cluster_key, self.footer.get("incarnation") or "")

    def check_footer(self) -> None:
        """The footer and the row count say what the manifest says."""
        found = self.footer.get("format") or "0"
        if not found.isdigit() or int(found) > OBJECT_FORMAT:
            raise ArchiveError(
                f"{self.where}: its format {found} is not one this Waltz reads "
                f"({OBJECT_FORMAT}): a newer Waltz wrote it, upgrade"
            )
        a = self.archived
        expected = {
            "partition": str(self.partition_id),
            "first": str(a.first),
            "last": str(a.last),
            "records": str(a.records),
            "digest": str(a.digest),
        }
        for name, value in expected.items():
            if self.footer.get(name) != value:
                raise ArchiveError(
                    f"{self.where}: its footer says {name}={self.footer.get(name)}, the "
                    f"manifest {value}"
                )
        if self.rows != a.records:
            raise ArchiveError(f"{self.where}: holds {self.rows} rows, expected {a.records}")

    def row_group_of(self, transaction_id: int) -> int:
        return bisect.bisect_right(self.row_starts, transaction_id) - 1

    def read_row_group(self, index: int, verify_data: bool = True) -> pa.Table:
        """Row group ``index`` (its ids and, ``verify_data``, its checksums checked)."""
        try:
            with self._lock:
                table = self.file.read_row_group(index)
        except Exception as exc:
            raise ArchiveError(
                f"{self.where}: row group {index} cannot be read: {type(exc).__name__}: {exc} "
                "(the archived object is corrupted)"
            ) from exc
        check_rows(table, self.row_starts[index], self.where, verify_data)
        return table

    def iter_row_groups(self, verify_data: bool = True) -> Iterator[pa.Table]:
        for index in range(len(self.row_starts)):
            yield self.read_row_group(index, verify_data)


def verify_object(
    store: ArchiveStore,
    partition_id: int,
    archived: ArchivedRange,
    fingerprint: Fingerprint | None = None,
) -> tuple[int, int]:
    """Read the whole object back: footer, row count, ids, every data checksum and the
    digest must be what ``archived`` says. Returns (records, data bytes), and feeds every
    row to ``fingerprint`` when given; raises ArchiveError naming the partition, the
    range and the object."""
    reader = RangeFile(store, partition_id, archived)
    try:
        reader.check_footer()
        digest = Digest()
        data_bytes = 0
        for table in reader.iter_row_groups():
            digest.add_batch(table)
            data_bytes += _data_bytes(table)
            if fingerprint is not None:
                fingerprint.add_batch(table)
        if digest.records != archived.records or digest.value != archived.digest:
            raise ArchiveError(
                f"{reader.where}: the rows' digest {digest.value} over {digest.records} records "
                f"does not match the range's {archived.digest} over {archived.records}"
            )
        return digest.records, data_bytes
    finally:
        reader.close()


def _data_bytes(table: pa.Table) -> int:
    lengths = pc.binary_length(table.column("data"))
    total = pc.sum(lengths).as_py()
    return int(total or 0)


def range_from_footer(
    store: ArchiveStore, partition_id: int, name: str
) -> tuple[ArchivedRange, ArchiveIdentity | None]:
    """What an object's own name and footer say it holds (an orphan found after a crash),
    and who wrote it (None: an object written before objects carried an identity);
    verify it with :func:`verify_object`, and compare it with the log, before trusting
    it."""
    parsed = layout.RangeName.parse(name)
    if parsed is None:
        raise ArchiveError(f"{name} is not the name of an archived range")
    path = object_path(store, partition_id, name)
    size = store.size(path)
    probe = ArchivedRange(parsed.first, parsed.last, name, size, 0, 0)
    reader = RangeFile(store, partition_id, probe)
    try:
        footer = reader.footer
        try:
            digest = int(footer["digest"] or "")
            data_bytes = int(footer["data_bytes"] or "0")
        except ValueError:
            raise ArchiveError(f"{reader.where}: its footer has no valid digest") from None
        archived = ArchivedRange(parsed.first, parsed.last, name, size, data_bytes, digest)
        return archived, reader.identity
    finally:
        reader.close()
