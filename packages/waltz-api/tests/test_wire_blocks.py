"""RecordBlock: records kept in their wire form (range reads pass them through)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_api import wire
from waltz_api.errors import ChecksumError, ProtocolError
from waltz_api.messages import RangeReadResponse, RecordListResponse
from waltz_api.types import Record, ReqId

RUNS = settings(max_examples=60, deadline=None)
DATA = st.binary(max_size=40)


def record(txid: int, data: bytes) -> Record:
    return Record(txid, ReqId(7, 1, 2, txid % 1000), txid % 5 - 2, data, wire.checksum(data))


def dense(first: int, datas: list[bytes]) -> tuple[Record, ...]:
    return tuple(record(first + i, d) for i, d in enumerate(datas))


@RUNS
@given(st.integers(0, 2**40), st.lists(DATA, max_size=12))
def test_a_block_is_its_records(first: int, datas: list[bytes]) -> None:
    records = dense(first, datas)
    block = wire.RecordBlock.of(records)
    assert len(block) == len(records)
    assert block.raw == wire.encode_records(records)
    assert block == records and records == block
    assert list(block) == list(records)
    assert block.records() == records
    assert block.first_transaction_id == (first if records else None)
    assert block.last_transaction_id == (first + len(records) - 1 if records else None)
    assert block.check(first) == block.offsets()
    assert block.offsets()[-1] == len(block.raw)
    assert len(block.offsets()) == len(records) + 1
    for n in range(len(records) + 2):
        assert block.cut(n).records() == records[:n]
    assert wire.RecordBlock.parse(len(records), block.raw) == block
    assert hash(block) == hash(records)


@RUNS
@given(st.lists(DATA, max_size=8), st.booleans())
def test_a_block_travels_as_the_same_frame(datas: list[bytes], storage: bool) -> None:
    records = dense(10, datas)
    message: RangeReadResponse | RecordListResponse = (
        RecordListResponse(1, 2, 3, records)
        if storage
        else RangeReadResponse(ReqId(1, 2, 3, 4), 99, records)
    )
    frame = wire.encode(message)
    as_block = dataclasses.replace(message, records=wire.RecordBlock.of(records))
    assert wire.encode(as_block) == frame
    lazy = wire.decode(frame, record_blocks=True)
    assert isinstance(lazy.records, wire.RecordBlock)  # type: ignore[attr-defined]
    expected_last = records[-1].transaction_id if records else None
    assert lazy.records.last_transaction_id == expected_last  # type: ignore[attr-defined]
    assert lazy == message == wire.decode(frame)
    assert wire.encode(lazy) == frame  # forwarded as it came


def test_a_corrupt_record_is_found_when_the_block_is_read() -> None:
    records = dense(0, [b"alpha", b"beta", b"gamma"])
    frame = bytearray(wire.encode(RangeReadResponse(ReqId(1, 2, 3, 4), 2, records)))
    frame[-2] ^= 0x01  # a bit of gamma's data
    with pytest.raises(ChecksumError):
        wire.decode(bytes(frame))
    block = wire.decode(bytes(frame), record_blocks=True).records  # type: ignore[attr-defined]
    assert isinstance(block, wire.RecordBlock)
    with pytest.raises(ChecksumError, match="transaction 2"):
        block.check()
    with pytest.raises(ChecksumError):
        list(block)


def test_ids_out_of_sequence_are_refused_by_check() -> None:
    block = wire.RecordBlock.of((record(5, b"a"), record(7, b"b")))
    block.check()  # the checksums are fine
    with pytest.raises(ProtocolError, match="7 where 6 was expected"):
        block.check(5)
    with pytest.raises(ProtocolError, match="dense from 4"):
        block.check(4)


def test_parse_refuses_bytes_that_are_not_the_records() -> None:
    raw = wire.encode_records(dense(0, [b"x", b"yy"]))
    with pytest.raises(ProtocolError):
        wire.RecordBlock.parse(3, raw)
    with pytest.raises(ProtocolError):
        wire.RecordBlock.parse(2, raw + b"\0")
    with pytest.raises(ProtocolError):
        wire.RecordBlock.parse(2, raw[:-1])
    with pytest.raises(ProtocolError):
        wire.RecordBlock.parse(1_000_000, raw)


def test_the_repr_of_a_large_block_is_short() -> None:
    block = wire.RecordBlock.of(dense(3, [b"z" * 1000] * 100))
    assert repr(block) == "RecordBlock(100 records, 103600 bytes, first transaction 3)"
