"""The fs partition's read path: records read with ``pread`` through the index of a
published view (:mod:`waltz_storage_fs.views`), in a thread of the engine's runner;
nothing keeps a segment, or an index, in memory."""

from __future__ import annotations

import bisect
import operator
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import crc32c

from waltz_api.errors import CorruptionError
from waltz_api.types import Record
from waltz_api.wire import RecordBlock
from waltz_storage_fs import format as fmt
from waltz_storage_fs.files import Files
from waltz_storage_fs.views import SegView, View

_BLOCK_HEAD = struct.Struct(">q20xiI")  # a stored record's id, data length, data crc
_WIRE_FIXED = fmt.RECORD_HEAD.size  # 36: the stored head, as long as the wire's
_SPLIT_HEAD = struct.Struct(">28s4s4s")  # id + ReqId + header, length, data crc


class PartitionReads:
    """The read path of :class:`~waltz_storage_fs.partition.FsStoragePartition` (a base
    class: it reads the partition's id, file layer and directory)."""

    partition_id: int
    directory: Path
    """The partition's directory (in the storage directory, its parent)."""
    _files: Files

    def _read_now(
        self, view: View, start: int, max_records: int, max_bytes: int, headers: bool
    ) -> list[Record]:
        out: list[Record] = []
        for seg, txid, buf, lo, offsets, k in self._spans(
            view, start, max_records, max_bytes, headers
        ):
            mv = memoryview(buf)
            for i in range(k):
                try:
                    record, end = fmt.decode_record(mv, offsets[i] - lo)
                except fmt.RecordFormatError as exc:
                    raise CorruptionError(
                        f"partition {self.partition_id}: transaction {txid + i} is corrupt "
                        f"({exc}) in segment {seg.first} at offset {offsets[i]}"
                    ) from exc
                if record.transaction_id != txid + i or end != offsets[i + 1] - lo:
                    raise CorruptionError(
                        f"partition {self.partition_id}: the record at offset {offsets[i]} of "
                        f"segment {seg.first} is not transaction {txid + i}"
                    )
                out.append(record)
        return out

    def _read_block_now(
        self, view: View, start: int, max_records: int, max_bytes: int
    ) -> RecordBlock:
        """The records as a wire block, built from the stored bytes: each record's
        checksums (of its stored head and of its data) and id are verified, then its
        bytes are rearranged to the wire layout (no Record is built)."""
        parts: list[bytes] = []
        append = parts.append
        unpack = _BLOCK_HEAD.unpack_from
        split = _SPLIT_HEAD.unpack_from
        unpack_crc = fmt.RECORD_CRC.unpack_from
        crc = crc32c.crc32c
        count = 0
        # (bytes slices: cheaper than memoryview slices for pieces this small)
        for seg, txid, buf, lo, offsets, k in self._spans(
            view, start, max_records, max_bytes, False
        ):
            for i in range(k):
                a = offsets[i] - lo
                b = offsets[i + 1] - lo
                found, length, data_crc = unpack(buf, a)
                d = a + _WIRE_FIXED
                e = b - 4
                head = buf[a:d]
                if found != txid + i or d + length != e or crc(head) != unpack_crc(buf, e)[0]:
                    self._corrupt(buf[a:b], txid + i, seg.first, offsets[i])
                data = buf[d:e]
                if crc(data) != data_crc:
                    self._corrupt(buf[a:b], txid + i, seg.first, offsets[i])
                # stored: id, ReqId, header, length, crc, data, head crc
                # wire:   id, ReqId, header, crc, length, data
                ids, stored_length, stored_crc = split(head)
                append(ids)
                append(stored_crc)
                append(stored_length)
                append(data)
            count += k
        return RecordBlock(count, b"".join(parts))

    def _corrupt(self, raw: bytes, txid: int, segment: int, offset: int) -> NoReturn:
        try:
            record, _ = fmt.decode_record(raw, 0)
        except fmt.RecordFormatError as exc:
            raise CorruptionError(
                f"partition {self.partition_id}: transaction {txid} is corrupt "
                f"({exc}) in segment {segment} at offset {offset}"
            ) from exc
        raise CorruptionError(
            f"partition {self.partition_id}: the record at offset {offset} of "
            f"segment {segment} is not transaction {txid} (it holds {record.transaction_id})"
        )

    def _missing(self, view: View, txid: int) -> CorruptionError:
        hole = next(((a, b) for a, b in view.missing if a <= txid <= b), (txid, txid))
        where = self.directory.parent / fmt.QUARANTINE_DIR_NAME / str(self.partition_id)
        return CorruptionError(
            f"partition {self.partition_id}: transaction {txid} is missing: transactions "
            f"{hole[0]}..{hole[1]} were lost to damage found at start-up or by a scrub (what "
            f"was left of them is in {where}); the server repairs them from a peer"
        )

    def _spans(
        self, view: View, start: int, max_records: int, max_bytes: int, headers: bool
    ) -> Iterator[tuple[SegView, int, bytes, int, list[int], int]]:
        """The stored bytes of the records to read, one span per segment:
        ``(segment, first id, bytes, file offset of the bytes, record offsets, count)``;
        the index's offsets are checked, the records are not."""
        firsts = [s.first for s in view.segments]
        txid = start
        taken = 0
        budget = max_bytes  # data bytes still allowed (records), span bytes per pread (headers)
        span_cap = 8 * 1024 * 1024
        while taken < max_records and txid <= view.max_txid:
            at = bisect.bisect_right(firsts, txid) - 1
            seg = view.segments[at] if at >= 0 else None
            if seg is None or txid >= seg.first + seg.count:
                if taken:
                    break  # a hole: the records before it are the answer
                raise self._missing(view, txid)
            rel = txid - seg.first
            n = min(max_records - taken, seg.count - rel)
            want = n + 1 if rel + n < seg.count else n
            raw = self._files.pread(
                seg.index_fd,
                want * fmt.INDEX_ENTRY_SIZE,
                fmt.HEADER_SIZE + rel * fmt.INDEX_ENTRY_SIZE,
            )
            if len(raw) != want * fmt.INDEX_ENTRY_SIZE:
                raise CorruptionError(
                    f"partition {self.partition_id}: the index of segment {seg.first} is "
                    "shorter than the segment"
                )
            offsets = fmt.unpack_offsets(raw)
            if want == n:
                offsets.append(seg.end)
            # how many records fit the byte budget (the very first one always does)
            k = 0
            data_bytes = 0
            whole = offsets[n] - offsets[0]
            if (whole <= span_cap) if headers else (whole - n * fmt.RECORD_OVERHEAD <= budget):
                k, data_bytes = n, whole - n * fmt.RECORD_OVERHEAD  # all of them (fast path)
            while k < n:
                span = offsets[k + 1] - offsets[k]
                if taken or k:
                    if headers and offsets[k + 1] - offsets[0] > span_cap:
                        break
                    if not headers and data_bytes + span - fmt.RECORD_OVERHEAD > budget:
                        break
                data_bytes += span - fmt.RECORD_OVERHEAD
                k += 1
            if k == 0:
                break
            lo, hi = offsets[0], offsets[k]
            if not fmt.HEADER_SIZE <= lo < hi <= seg.end or not all(
                map(operator.lt, offsets[:k], offsets[1 : k + 1])
            ):
                raise CorruptionError(
                    f"partition {self.partition_id}: the index of segment {seg.first} has "
                    f"invalid offsets around transaction {txid}"
                )
            buf = self._files.pread(seg.data_fd, hi - lo, lo)
            if len(buf) != hi - lo:
                raise CorruptionError(
                    f"partition {self.partition_id}: segment {seg.first} is shorter than its index"
                )
            yield seg, txid, buf, lo, offsets, k
            taken += k
            txid += k
            if not headers:
                budget -= data_bytes
            if k < n:
                break
