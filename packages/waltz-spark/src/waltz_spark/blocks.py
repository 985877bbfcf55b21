"""Record blocks straight into Arrow record batches (what a Spark executor yields).

A range read's answer is a :class:`~waltz_api.wire.RecordBlock`: the records in their
wire form, back to back (``i64 transaction_id, 4 x i32 ReqId, i32 header, u32
checksum, u32 data_len`` then the data). The reader has verified every checksum and
the ids (:meth:`RecordBlock.check`, which also gives where each record starts); the
columns are then cut out of the block with numpy, without a Python object per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from waltz_api.wire import RECORD_FIXED_SIZE, RecordBlock

_HEAD = np.dtype(
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
assert _HEAD.itemsize == RECORD_FIXED_SIZE
_HEAD_BYTES = np.arange(RECORD_FIXED_SIZE, dtype=np.int64)

COLUMNS = (
    "partition",
    "transaction_id",
    "header",
    "client_id",
    "generation",
    "req_partition",
    "seq_num",
    "data",
)
"""The columns of a batch, in order (the data source's schema)."""


def block_to_batch(
    partition: int,
    block: RecordBlock,
    offsets: Sequence[int],
    schema: pa.Schema,
    ids: frozenset[int] | None = None,
) -> pa.RecordBatch:
    """The rows of ``block`` (``offsets``: :meth:`RecordBlock.check`'s answer, the start
    of each record and the end of the block) as a batch of ``schema`` (the columns of
    :data:`COLUMNS`); only the rows whose transaction id is in ``ids`` when given."""
    n = block.record_count
    if n == 0:
        return _empty(schema)
    raw = np.frombuffer(block.raw, dtype=np.uint8)
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    head_index = starts[:, None] + _HEAD_BYTES
    heads = raw[head_index].view(_HEAD).reshape(n)
    lengths = heads["data_len"].astype(np.int64)
    keep = np.ones(raw.shape[0], dtype=np.bool_)
    keep[head_index.ravel()] = False
    data = raw[keep]
    data_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=data_offsets[1:])
    columns = [
        pa.array(np.full(n, partition, dtype=np.int32)),
        pa.array(heads["transaction_id"].astype(np.int64)),
        pa.array(heads["header"].astype(np.int32)),
        pa.array(heads["client_id"].astype(np.int32)),
        pa.array(heads["generation"].astype(np.int32)),
        pa.array(heads["partition_id"].astype(np.int32)),
        pa.array(heads["seq_num"].astype(np.int32)),
        pa.Array.from_buffers(
            pa.binary(), n, [None, pa.py_buffer(data_offsets), pa.py_buffer(data)]
        ),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    if ids is not None:
        chosen = np.isin(heads["transaction_id"].astype(np.int64), np.fromiter(ids, np.int64))
        batch = batch.filter(pa.array(chosen))
    return batch


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)
