"""Records and record headers on the wire, and :class:`RecordBlock`: records kept in
their wire form from a storage node's disk to the reader.

A record list (``record*``) is its records back to back, each
``i64 transaction_id, ReqId, i32 header, u32 checksum, u32 data_len`` and its data; a
header list (``header*``) is ``i64 transaction_id, ReqId, i32 header`` each. Decoding
verifies each record's CRC-32C, except into a block, whose reader verifies them once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, overload

from waltz_api.errors import (
    ProtocolError,
)
from waltz_api.types import Record, RecordHeader, ReqId
from waltz_api.wire.construct import (
    RECORD_SETTERS,
    REQ_ID_SETTERS,
    make_record_header,
    make_req_id,
)
from waltz_api.wire.schema import (
    ENCODE_ERRORS,
    RECORD_FIXED_SIZE,
    RECORD_HEADER_SIZE,
    bad_checksum,
    crc32c,
    trailing,
    truncated,
)

# -- records and headers ----------------------------------------------------------------

_RECORD: Final = struct.Struct(">qiiiiiII")
_HEADER: Final = struct.Struct(">qiiiii")


def _record_parts(records: Iterable[Record]) -> list[bytes]:
    parts: list[bytes] = []
    append = parts.append
    pack = _RECORD.pack
    for r in records:
        q = r.req_id
        data = r.data
        append(
            pack(
                r.transaction_id,
                q.client_id,
                q.generation,
                q.partition_id,
                q.seq_num,
                r.header,
                r.checksum,
                len(data),
            )
        )
        append(data)
    return parts


def encode_records(records: Iterable[Record]) -> bytes:
    """The wire form of ``records`` back to back (one join): the tail of a record list.
    A :class:`RecordBlock` is that already (its bytes are used as they are)."""
    if type(records) is RecordBlock:
        return records.raw
    return b"".join(_record_parts(records))


def encode_headers(headers: Iterable[RecordHeader]) -> bytes:
    pack = _HEADER.pack
    return b"".join(
        [
            pack(
                h.transaction_id,
                h.req_id.client_id,
                h.req_id.generation,
                h.req_id.partition_id,
                h.req_id.seq_num,
                h.header,
            )
            for h in headers
        ]
    )


def encode_optional_record(record: Record | None) -> bytes:
    return b"" if record is None else encode_records((record,))


def encode_optional_header(header: RecordHeader | None) -> bytes:
    return b"" if header is None else encode_headers((header,))


def decode_records(
    frame: bytes, offset: int, count: int, end: int, what: str, *, verify: bool = True
) -> tuple[tuple[Record, ...], int]:
    """The ``count`` records at ``offset``; each record's CRC-32C is verified unless not
    ``verify`` (see :func:`decode_unverified_records`)."""
    if count * RECORD_FIXED_SIZE > end - offset:
        raise truncated(f"{what} with {count} records", offset + count * RECORD_FIXED_SIZE, end)
    unpack = _RECORD.unpack_from
    records: list[Record] = []
    append = records.append
    new = object.__new__
    set_cid, set_gen, set_pid, set_seq = REQ_ID_SETTERS
    set_txid, set_req_id, set_header, set_data, set_crc = RECORD_SETTERS
    for _ in range(count):
        if offset + RECORD_FIXED_SIZE > end:
            raise truncated(f"record in a {what}", offset + RECORD_FIXED_SIZE, end)
        txid, cid, gen, pid, seq, header, crc, length = unpack(frame, offset)
        offset += RECORD_FIXED_SIZE
        data_end = offset + length
        if data_end > end:
            raise truncated(f"data of record {txid} in a {what}", data_end, end)
        data = frame[offset:data_end]
        if verify and crc32c(data) != crc:
            raise bad_checksum(f"record in a {what}", f" (transaction {txid})", crc, crc32c(data))
        # Record(txid, ReqId(cid, gen, pid, seq), header, data, crc), built without __init__
        req_id = new(ReqId)
        set_cid(req_id, cid)
        set_gen(req_id, gen)
        set_pid(req_id, pid)
        set_seq(req_id, seq)
        record = new(Record)
        set_txid(record, txid)
        set_req_id(record, req_id)
        set_header(record, header)
        set_data(record, data)
        set_crc(record, crc)
        append(record)
        offset = data_end
    return tuple(records), offset


def decode_unverified_records(
    frame: bytes, offset: int, count: int, end: int, what: str
) -> tuple[tuple[Record, ...], int]:
    """:func:`decode_records` without verifying the checksums: for a receiver that hands
    the records to a storage engine, which verifies each one as it stores it."""
    return decode_records(frame, offset, count, end, what, verify=False)


# -- record blocks ----------------------------------------------------------------------------

_TXID: Final = struct.Struct(">q")
_DATA_LEN: Final = struct.Struct(">I")
_ID_CRC_LEN: Final = struct.Struct(">q20xII")
_DATA_LEN_AT: Final = RECORD_FIXED_SIZE - 4


class RecordBlock(Sequence[Record]):
    """Records in their wire form, back to back (the tail of a record list), as one block.

    A range read moves records from a storage node's disk through the server to a
    reader: the storage node builds the block straight from its segment files, the
    server forwards it as it came (no :class:`~waltz_api.types.Record` is built on the
    way) and the reader decodes it once. A block is a ``Sequence[Record]``: indexing or
    iterating decodes it (once; the records are kept) and verifies every record's
    CRC-32C. :meth:`check` verifies the checksums without building records.

    Built by :meth:`of` (from records), by a storage engine (``read_block``), or by
    :func:`decode` with ``record_blocks=True`` (RangeReadResponse and
    RecordListResponse), which checks the block's structure (every record within the
    frame) but leaves the checksums to whoever reads the records. ``raw`` must hold
    exactly ``count`` well-formed records; the constructor trusts its caller (use
    :meth:`parse` for bytes from elsewhere).
    """

    __slots__ = ("_last_at", "_records", "raw", "record_count")

    def __init__(self, count: int, raw: bytes) -> None:
        self.record_count = count
        """How many records ``raw`` holds."""
        self.raw = raw
        self._records: tuple[Record, ...] | None = None
        self._last_at = -1  # where the last record starts, once known

    @classmethod
    def of(cls, records: Iterable[Record]) -> RecordBlock:
        """The block of ``records`` (encoded once)."""
        if type(records) is RecordBlock:
            return records
        chosen = records if isinstance(records, Sequence) else tuple(records)
        try:
            raw = b"".join(_record_parts(chosen))
        except ENCODE_ERRORS as exc:
            raise ProtocolError(f"cannot encode a record: {exc}") from exc
        return cls(len(chosen), raw)

    @classmethod
    def parse(cls, count: int, raw: bytes, what: str = "record block") -> RecordBlock:
        """A block of ``count`` records in ``raw``; raises :class:`ProtocolError` when
        ``raw`` does not hold exactly that many records (checksums are not checked)."""
        block, used = decode_block(raw, 0, count, len(raw), what)
        if used != len(raw):
            raise trailing(what, used, len(raw))
        return block

    @property
    def first_transaction_id(self) -> int | None:
        """The first record's transaction id (None: an empty block)."""
        return _TXID.unpack_from(self.raw, 0)[0] if self.record_count else None

    @property
    def last_transaction_id(self) -> int | None:
        """The last record's transaction id (None: an empty block)."""
        if not self.record_count:
            return None
        if self._last_at < 0:
            self._last_at = self.offsets()[-2]
        return _TXID.unpack_from(self.raw, self._last_at)[0]  # type: ignore[no-any-return]

    def offsets(self) -> list[int]:
        """Where each record starts in ``raw``, and ``len(raw)`` last (``count + 1`` values)."""
        raw = self.raw
        unpack = _DATA_LEN.unpack_from
        at = 0
        starts = [0] * (self.record_count + 1)
        for i in range(self.record_count):
            at += RECORD_FIXED_SIZE + unpack(raw, at + _DATA_LEN_AT)[0]
            starts[i + 1] = at
        return starts

    def check(self, first_transaction_id: int | None = None) -> list[int]:
        """Verify every record's data checksum (and, given ``first_transaction_id``, that
        the ids are dense from it) without building records; returns :meth:`offsets`.

        Raises :class:`ChecksumError` for a corrupt record, :class:`ProtocolError` for
        ids out of sequence."""
        if self._records is not None:
            decoded = self._records  # checked when decoded
            if first_transaction_id is not None:
                _check_dense(decoded, first_transaction_id)
            return self.offsets()
        raw = self.raw
        unpack = _ID_CRC_LEN.unpack_from
        crc_of = crc32c
        at = 0
        count = self.record_count
        expected = first_transaction_id
        starts = [0] * (count + 1)
        for i in range(count):
            txid, crc, length = unpack(raw, at)
            start = at + RECORD_FIXED_SIZE
            at = start + length
            data = raw[start:at]  # (a bytes slice: cheaper than a memoryview's here)
            if crc_of(data) != crc:
                raise bad_checksum("record in a block", f" (transaction {txid})", crc, crc_of(data))
            if expected is not None and txid != expected + i:
                raise _not_dense(txid, expected + i, expected)
            starts[i + 1] = at
        return starts

    def cut(self, count: int) -> RecordBlock:
        """The block of the first ``count`` records (at a record boundary)."""
        if count >= self.record_count:
            return self
        if count <= 0:
            return RecordBlock(0, b"")
        unpack = _DATA_LEN.unpack_from
        at = 0
        for _ in range(count):
            at += RECORD_FIXED_SIZE + unpack(self.raw, at + _DATA_LEN_AT)[0]
        return RecordBlock(count, self.raw[:at])

    def records(self) -> tuple[Record, ...]:
        """The decoded records (every checksum verified; decoded once)."""
        if self._records is None:
            decoded, used = decode_records(
                self.raw, 0, self.record_count, len(self.raw), "record block"
            )
            if used != len(self.raw):
                raise trailing("record block", used, len(self.raw))
            self._records = decoded
        return self._records

    def __len__(self) -> int:
        return self.record_count

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Record, ...]: ...

    def __getitem__(self, index: int | slice) -> Record | tuple[Record, ...]:
        return self.records()[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordBlock):
            return self.record_count == other.record_count and self.raw == other.raw
        if isinstance(other, (tuple, list)):
            return len(other) == self.record_count and self.records() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.records())

    def __repr__(self) -> str:
        # short: an asyncio task or a log line may repr a response holding a large block
        first = self.first_transaction_id
        where = f", first transaction {first}" if first is not None else ""
        return f"RecordBlock({self.record_count} records, {len(self.raw)} bytes{where})"


def _check_dense(records: Sequence[Record], first: int) -> None:
    for i, record in enumerate(records):
        if record.transaction_id != first + i:
            raise _not_dense(record.transaction_id, first + i, first)


def _not_dense(found: int, expected: int, first: int) -> ProtocolError:
    return ProtocolError(
        f"a record block holds transaction {found} where {expected} was expected "
        f"(the records must be dense from {first})"
    )


def decode_block(
    frame: bytes, offset: int, count: int, end: int, what: str
) -> tuple[RecordBlock, int]:
    """The ``count`` records at ``offset`` as a block: every record is checked to lie
    within the frame; the checksums are left to the block's reader."""
    if count * RECORD_FIXED_SIZE > end - offset:
        raise truncated(f"{what} with {count} records", offset + count * RECORD_FIXED_SIZE, end)
    unpack = _DATA_LEN.unpack_from
    at = last = offset
    limit = end - RECORD_FIXED_SIZE
    for _ in range(count):
        if at > limit:
            raise truncated(f"record in a {what}", at + RECORD_FIXED_SIZE, end)
        last = at
        at += RECORD_FIXED_SIZE + unpack(frame, at + _DATA_LEN_AT)[0]
    if at > end:
        raise truncated(f"data of a record in a {what}", at, end)
    block = RecordBlock(count, frame[offset:at])
    block._last_at = last - offset
    return block, at


def decode_headers(
    frame: bytes, offset: int, count: int, end: int, what: str
) -> tuple[tuple[RecordHeader, ...], int]:
    stop = offset + count * RECORD_HEADER_SIZE
    if stop > end:
        raise truncated(f"{what} with {count} record headers", stop, end)
    headers = tuple(
        [
            make_record_header(txid, make_req_id(cid, gen, pid, seq), header)
            for txid, cid, gen, pid, seq, header in _HEADER.iter_unpack(frame[offset:stop])
        ]
    )
    return headers, stop


def decode_optional_record(
    frame: bytes, offset: int, present: int, end: int, what: str
) -> tuple[Record | None, int]:
    if present == 0:
        return None, offset
    if present != 1:
        raise ProtocolError(f"bad presence byte {present} in a {what} (must be 0 or 1)")
    records, offset = decode_records(frame, offset, 1, end, what)
    return records[0], offset


def decode_optional_header(
    frame: bytes, offset: int, present: int, end: int, what: str
) -> tuple[RecordHeader | None, int]:
    if present == 0:
        return None, offset
    if present != 1:
        raise ProtocolError(f"bad presence byte {present} in a {what} (must be 0 or 1)")
    headers, offset = decode_headers(frame, offset, 1, end, what)
    return headers[0], offset
