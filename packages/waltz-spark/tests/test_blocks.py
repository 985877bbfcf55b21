"""Record blocks to Arrow batches (numpy, no Python object per row): the same rows as
decoding every record, for any record sizes; corrupt or out-of-order records refused."""

from __future__ import annotations

import random

import pytest

from waltz_api import wire
from waltz_api.errors import ChecksumError, ProtocolError
from waltz_api.messages import RangeReadResponse
from waltz_api.types import Record, ReqId
from waltz_spark.blocks import COLUMNS, block_to_batch
from waltz_spark.datasource import ARROW_SCHEMA, records_to_batch


def make_records(first: int, sizes: list[int], seed: int = 1) -> tuple[Record, ...]:
    rng = random.Random(seed)
    records = []
    for i, size in enumerate(sizes):
        data = rng.randbytes(size)
        req_id = ReqId(rng.randrange(-5, 2**31), rng.randrange(0, 9), 3, -rng.randrange(0, 99))
        header = rng.randrange(-(2**31), 2**31)
        records.append(Record(first + i, req_id, header, data, wire.checksum(data)))
    return tuple(records)


@pytest.mark.parametrize(
    "sizes",
    [[0], [5] * 40, [0, 1, 2, 300, 0, 7, 64 * 1024, 3], [100] * 1000],
    ids=["one-empty", "uniform", "mixed", "thousand"],
)
def test_a_block_becomes_the_same_batch_as_its_records(sizes: list[int]) -> None:
    records = make_records(2**33, sizes)
    block = wire.RecordBlock.of(records)
    batch = block_to_batch(4, block, block.check(2**33), ARROW_SCHEMA)
    assert batch.schema == ARROW_SCHEMA
    assert tuple(batch.schema.names) == COLUMNS
    assert batch.equals(records_to_batch(4, records))
    # through the wire, as a reader receives it
    frame = wire.encode(RangeReadResponse(ReqId(1, 2, 3, 4), 0, records))
    received = wire.decode(frame, record_blocks=True).records  # type: ignore[attr-defined]
    assert isinstance(received, wire.RecordBlock)
    again = block_to_batch(4, received, received.check(2**33), ARROW_SCHEMA)
    assert again.equals(batch)


def test_ids_select_rows_and_an_empty_block_is_an_empty_batch() -> None:
    records = make_records(10, [3, 4, 5, 6, 7])
    block = wire.RecordBlock.of(records)
    chosen = block_to_batch(0, block, block.check(10), ARROW_SCHEMA, frozenset({11, 14, 99}))
    assert chosen.column("transaction_id").to_pylist() == [11, 14]
    assert chosen.column("data").to_pylist() == [records[1].data, records[4].data]
    empty = wire.RecordBlock.of(())
    assert block_to_batch(0, empty, empty.check(0), ARROW_SCHEMA).num_rows == 0


def test_a_corrupt_or_misplaced_record_never_becomes_a_row() -> None:
    records = make_records(0, [20, 20, 20])
    raw = bytearray(wire.encode_records(records))
    raw[36 + 20 + 36 + 5] ^= 0x40  # a bit of the second record's data
    with pytest.raises(ChecksumError, match="transaction 1"):
        wire.RecordBlock.parse(3, bytes(raw)).check(0)
    block = wire.RecordBlock.of(records)
    with pytest.raises(ProtocolError, match="dense from 1"):
        block.check(1)
