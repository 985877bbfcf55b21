"""Records as Arrow columns: the archive's row layout, its digest and its checks.

A range's rows, in id order (docs/archive.md)::

    transaction_id int64 | client_id, generation, req_partition, seq_num int32 |
    header int32 | checksum int64 (CRC-32C of data) | data binary

The **digest** of a sequence of records is the CRC-32C of, per record, its 32-byte
head in the wire's order (big-endian ``i64 id, 4 x i32 ReqId, i32 header, u32
checksum``): the first 32 bytes of each record of a :class:`RecordBlock`. Together with
each record's own data checksum it covers every byte of the range; it is written in the
object's footer and checked when the object is read back.

Columns are cut from a block with numpy (no Python object per row); the per-row data
checksums are computed from the buffers, one C call per row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import crc32c
import numpy as np
import pyarrow as pa

from waltz_api.errors import ArchiveError
from waltz_api.types import Record, ReqId
from waltz_api.wire import RECORD_FIXED_SIZE, RecordBlock

SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.int64(), False),
        pa.field("client_id", pa.int32(), False),
        pa.field("generation", pa.int32(), False),
        pa.field("req_partition", pa.int32(), False),
        pa.field("seq_num", pa.int32(), False),
        pa.field("header", pa.int32(), False),
        pa.field("checksum", pa.int64(), False),
        pa.field("data", pa.binary(), False),
    ]
)
"""The columns of an archived range."""

HEAD_SIZE = 32
"""Bytes per record in the digest."""

WIRE_HEAD = np.dtype(
    [
        ("transaction_id", ">i8"),
        ("client_id", ">i4"),
        ("generation", ">i4"),
        ("partition_id", ">i4"),
        ("seq_num", ">i4"),
        ("header", ">i4"),
        ("checksum", ">u4"),
        ("data_len", ">u4"),
    ]
)
assert WIRE_HEAD.itemsize == RECORD_FIXED_SIZE
"""A record's fixed head on the wire (and in a RecordBlock), before its data."""
_DIGEST_HEAD = np.dtype(
    [
        ("transaction_id", ">i8"),
        ("client_id", ">i4"),
        ("generation", ">i4"),
        ("req_partition", ">i4"),
        ("seq_num", ">i4"),
        ("header", ">i4"),
        ("checksum", ">u4"),
    ]
)
assert _DIGEST_HEAD.itemsize == HEAD_SIZE
_HEAD_BYTES = np.arange(RECORD_FIXED_SIZE, dtype=np.int64)


def cut_block(
    block: RecordBlock, offsets: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """The records of ``block`` cut into columns with numpy, no Python object per row
    (``offsets``: :meth:`RecordBlock.check`'s answer, where each record starts and the
    block's end): each record's fixed head as a row of the wire's layout
    (:data:`WIRE_HEAD`), the same heads as bytes (one row of ``RECORD_FIXED_SIZE`` each),
    and the records' data as one Arrow binary array."""
    n = block.record_count
    raw = np.frombuffer(block.raw, dtype=np.uint8)
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    head_index = starts[:, None] + _HEAD_BYTES
    head_bytes = raw[head_index]
    heads = head_bytes.view(WIRE_HEAD).reshape(n)
    keep = np.ones(raw.shape[0], dtype=np.bool_)
    keep[head_index.ravel()] = False
    data_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(heads["data_len"].astype(np.int64), out=data_offsets[1:])
    data = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(data_offsets), pa.py_buffer(raw[keep])]
    )
    return heads, head_bytes, data


def block_to_batch(block: RecordBlock) -> tuple[pa.RecordBatch, bytes]:
    """The rows of ``block`` (its records' checksums verified) and their heads (what
    :meth:`Digest.add_heads` takes)."""
    if block.record_count == 0:
        return empty_batch(), b""
    # block.check(): every data checksum, and where each record starts
    heads, head_bytes, data = cut_block(block, block.check())
    digest_heads = np.ascontiguousarray(head_bytes[:, :HEAD_SIZE]).tobytes()
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(heads["transaction_id"].astype(np.int64)),
            pa.array(heads["client_id"].astype(np.int32)),
            pa.array(heads["generation"].astype(np.int32)),
            pa.array(heads["partition_id"].astype(np.int32)),
            pa.array(heads["seq_num"].astype(np.int32)),
            pa.array(heads["header"].astype(np.int32)),
            pa.array(heads["checksum"].astype(np.int64)),
            data,
        ],
        schema=SCHEMA,
    )
    return batch, digest_heads


def records_to_batch(records: Sequence[Record]) -> tuple[pa.RecordBatch, bytes]:
    """:func:`block_to_batch` of records (a RecordBlock is taken as it is)."""
    return block_to_batch(RecordBlock.of(records))


def empty_batch() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in SCHEMA], schema=SCHEMA)


class Digest:
    """The running digest of records fed in id order (batches of heads)."""

    __slots__ = ("records", "value")

    def __init__(self) -> None:
        self.value = 0
        self.records = 0

    def add_heads(self, heads: bytes, count: int) -> None:
        self.value = crc32c.crc32c(heads, self.value)
        self.records += count

    def add_batch(self, batch: pa.RecordBatch | pa.Table) -> None:
        """The heads of ``batch``'s rows (archive columns), in order."""
        if batch.num_rows:
            self.add_heads(digest_heads(batch), batch.num_rows)


def digest_heads(batch: pa.RecordBatch | pa.Table) -> bytes:
    """The digest's heads of ``batch``'s rows (:data:`HEAD_SIZE` bytes each), in order."""
    heads = np.empty(batch.num_rows, dtype=_DIGEST_HEAD)
    for name in (
        "transaction_id",
        "client_id",
        "generation",
        "req_partition",
        "seq_num",
        "header",
    ):
        heads[name] = _numpy(batch.column(name))
    heads["checksum"] = _numpy(batch.column("checksum")).astype(np.uint32)
    return heads.tobytes()


class Fingerprint:
    """SHA-256 of records fed in id order, however they are cut into batches: every
    record's head (id, request id, header, data checksum), every data length and every
    data byte. Two sequences of records with the same fingerprint are the same records
    (an archived object compared with the replicas' records of its ids)."""

    __slots__ = ("_data", "_heads", "_lengths", "records")

    def __init__(self) -> None:
        self._heads = hashlib.sha256()
        self._lengths = hashlib.sha256()
        self._data = hashlib.sha256()
        self.records = 0

    def add_batch(self, batch: pa.RecordBatch | pa.Table) -> None:
        n = batch.num_rows
        if n == 0:
            return
        self._heads.update(digest_heads(batch))
        column = batch.column("data")
        for chunk in column.chunks if isinstance(column, pa.ChunkedArray) else [column]:
            if len(chunk) == 0:
                continue
            _, offsets_buffer, data_buffer = chunk.buffers()
            offsets = np.frombuffer(offsets_buffer, dtype=np.int32)[
                chunk.offset : chunk.offset + len(chunk) + 1
            ]
            self._lengths.update(np.diff(offsets).astype(">i4").tobytes())
            if data_buffer is not None:
                self._data.update(memoryview(data_buffer)[int(offsets[0]) : int(offsets[-1])])
        self.records += n

    @property
    def value(self) -> str:
        """The fingerprint (hex)."""
        whole = hashlib.sha256()
        for part in (self._heads, self._lengths, self._data):
            whole.update(part.digest())
        whole.update(self.records.to_bytes(8, "big"))
        return whole.hexdigest()


def _numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    values: np.ndarray = column.to_numpy(zero_copy_only=False)
    return values


def check_rows(
    batch: pa.RecordBatch | pa.Table, first: int, where: str, verify_data: bool = True
) -> None:
    """Raise ArchiveError (``where`` names the object and range) unless the rows' ids are
    ``first, first + 1, ...`` and (``verify_data``) each row's data matches its checksum."""
    n = batch.num_rows
    if n == 0:
        return
    ids = _numpy(batch.column("transaction_id"))
    expected = np.arange(first, first + n, dtype=np.int64)
    if not np.array_equal(ids, expected):
        bad = int(np.argmax(ids != expected))
        raise ArchiveError(
            f"{where}: row {bad} holds transaction {int(ids[bad])}, expected {first + bad} "
            "(the object does not hold the range its name and manifest say)"
        )
    if not verify_data:
        return
    checksums = _numpy(batch.column("checksum"))
    data = batch.column("data")
    chunks = data.chunks if isinstance(data, pa.ChunkedArray) else [data]
    row = 0
    for chunk in chunks:
        for value in _binary_views(chunk):
            if crc32c.crc32c(value) != checksums[row]:
                raise ArchiveError(
                    f"{where}: transaction {first + row} fails its checksum (the archived "
                    "object is corrupted)"
                )
            row += 1


def _binary_views(array: pa.Array) -> Iterable[memoryview]:
    """Each value of a binary array, as a memoryview of its buffer (no copy)."""
    n = len(array)
    if n == 0:
        return
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)[array.offset : array.offset + n + 1]
    data = memoryview(data_buffer) if data_buffer is not None else memoryview(b"")
    bounds = offsets.tolist()
    for i in range(n):
        yield data[bounds[i] : bounds[i + 1]]


def batch_to_records(batch: pa.RecordBatch | pa.Table) -> list[Record]:
    """The rows as records (data copied out of the Arrow buffers)."""
    columns = [
        _numpy(batch.column(name)).tolist()
        for name in (
            "transaction_id",
            "client_id",
            "generation",
            "req_partition",
            "seq_num",
            "header",
            "checksum",
        )
    ]
    data = batch.column("data").to_pylist()
    return [
        Record(txid, ReqId(client, generation, partition, seq), header, value, checksum)
        for txid, client, generation, partition, seq, header, checksum, value in zip(
            *columns, data, strict=True
        )
    ]
