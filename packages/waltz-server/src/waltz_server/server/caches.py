"""Caches bounded in bytes: recent feed headers and transaction data."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from waltz_api.types import RecordHeader, ReqId

HEADER_COST = 160
"""Bytes one cached header takes in memory (a tuple of six ints in a deque; measured)."""

DATA_ENTRY_OVERHEAD = 230
"""Bytes one data cache entry takes besides its data (bytes object, tuple, checksum int,
ordered-dict slot; measured): the cache bounds its real memory, not just the payload."""

_Packed = tuple[int, int, int, int, int, int]


def _pack(header: RecordHeader) -> _Packed:
    r = header.req_id
    return (
        header.transaction_id,
        r.client_id,
        r.generation,
        r.partition_id,
        r.seq_num,
        header.header,
    )


def _unpack(packed: _Packed) -> RecordHeader:
    transaction_id, client_id, generation, partition_id, seq_num, header = packed
    return RecordHeader(transaction_id, ReqId(client_id, generation, partition_id, seq_num), header)


class FeedCache:
    """The most recent committed record headers, a contiguous id range, bounded in bytes.

    Feeds of clients near the head read from here; older positions fall back
    to storage. Headers are kept as tuples of ints, which the cyclic garbage
    collector stops tracking: a cache of a million headers adds nothing to a
    collection's pause.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_headers = max(1, max_bytes // HEADER_COST)
        self._headers: collections.deque[_Packed] = collections.deque()
        self.hits = 0
        self.misses = 0

    @property
    def first_id(self) -> int | None:
        return self._headers[0][0] if self._headers else None

    @property
    def last_id(self) -> int | None:
        return self._headers[-1][0] if self._headers else None

    def __len__(self) -> int:
        return len(self._headers)

    def add(self, headers: Iterable[RecordHeader]) -> None:
        for header in headers:
            if self._headers and header.transaction_id != self._headers[-1][0] + 1:
                self._headers.clear()  # keep the range contiguous
            self._headers.append(_pack(header))
            if len(self._headers) > self.max_headers:
                self._headers.popleft()

    def clear(self) -> None:
        self._headers.clear()

    def get(self, start: int, max_count: int) -> list[RecordHeader]:
        """Headers from ``start`` when the cache holds ``start``, else []."""
        first = self.first_id
        if first is None or start < first or start > self._headers[-1][0]:
            self.misses += 1
            return []
        self.hits += 1
        offset = start - first
        end = min(len(self._headers), offset + max_count)
        return [_unpack(self._headers[i]) for i in range(offset, end)]


class DataCache:
    """Transaction data by id, least recently used first out, bounded in bytes of memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: collections.OrderedDict[int, tuple[bytes, int]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def put(self, transaction_id: int, data: bytes, checksum: int) -> None:
        cost = len(data) + DATA_ENTRY_OVERHEAD
        if cost > self.max_bytes:
            return
        previous = self._data.pop(transaction_id, None)
        if previous is not None:
            self.bytes -= len(previous[0]) + DATA_ENTRY_OVERHEAD
        self._data[transaction_id] = (data, checksum)
        self.bytes += cost
        while self.bytes > self.max_bytes:
            _, (evicted, _) = self._data.popitem(last=False)
            self.bytes -= len(evicted) + DATA_ENTRY_OVERHEAD

    def get(self, transaction_id: int) -> tuple[bytes, int] | None:
        found = self._data.get(transaction_id)
        if found is None:
            self.misses += 1
            return None
        self._data.move_to_end(transaction_id)
        self.hits += 1
        return found

    def discard_above(self, transaction_id: int) -> None:
        """Forget ids above ``transaction_id`` (they were truncated by recovery)."""
        for key in [k for k in self._data if k > transaction_id]:
            self.bytes -= len(self._data.pop(key)[0]) + DATA_ENTRY_OVERHEAD
