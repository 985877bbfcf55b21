"""Record blocks straight into Arrow record batches (what a Spark executor yields).

A range read's answer is a :class:`~waltz_api.wire.RecordBlock`: the records in their
wire form, back to back (``i64 transaction_id, 4 x i32 ReqId, i32 header, u32
checksum, u32 data_len`` then the data). The reader has verified every checksum and
the ids (:meth:`RecordBlock.check`, which also gives where each record starts); the
columns are then cut out of the block with numpy, without a Python object per row
(:func:`waltz_archive.records.cut_block`, which the archive uses too).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from waltz_api.wire import RecordBlock
from waltz_archive.records import cut_block

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
    heads, _, data = cut_block(block, offsets)
    columns = [
        pa.array(np.full(n, partition, dtype=np.int32)),
        pa.array(heads["transaction_id"].astype(np.int64)),
        pa.array(heads["header"].astype(np.int32)),
        pa.array(heads["client_id"].astype(np.int32)),
        pa.array(heads["generation"].astype(np.int32)),
        pa.array(heads["partition_id"].astype(np.int32)),
        pa.array(heads["seq_num"].astype(np.int32)),
        data,
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    if ids is not None:
        chosen = np.isin(heads["transaction_id"].astype(np.int64), np.fromiter(ids, np.int64))
        batch = batch.filter(pa.array(chosen))
    return batch


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)
