"""Test records: the one ``make_record`` of the suites, the server's tests and benchmarks.

Arguments in the order of the record (transaction id, then partition); the data is
derived from both, so a check needs no bookkeeping and a record read back from the
wrong place or the wrong partition differs from the expected one.
"""

from __future__ import annotations

import crc32c

from waltz_api.types import Record, ReqId


def record_data(transaction_id: int, partition_id: int = 0, size: int | None = None) -> bytes:
    """Deterministic data for a transaction: of varied lengths, or exactly ``size`` bytes."""
    unit = f"p{partition_id}-t{transaction_id}|".encode()
    if size is None:
        return unit * (1 + transaction_id % 4)
    return (unit * (size // len(unit) + 1))[:size]


def make_record(
    transaction_id: int,
    partition_id: int = 0,
    data: bytes | None = None,
    *,
    size: int | None = None,
) -> Record:
    """A record of ``transaction_id`` in ``partition_id`` with a correct CRC-32C (its data
    :func:`record_data` unless given)."""
    if data is None:
        data = record_data(transaction_id, partition_id, size)
    return Record(
        transaction_id,
        ReqId(client_id=7, generation=3, partition_id=partition_id, seq_num=transaction_id),
        header=transaction_id % 1000,
        data=data,
        checksum=crc32c.crc32c(data),
    )


def make_records(
    start: int, count: int, *, partition_id: int = 0, size: int | None = None
) -> list[Record]:
    """``count`` records of ``partition_id`` from transaction ``start``."""
    return [make_record(start + i, partition_id, size=size) for i in range(count)]
