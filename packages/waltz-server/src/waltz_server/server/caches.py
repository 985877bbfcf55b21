"""Caches bounded in bytes: recent feed frames and transaction data."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

from waltz_api.wire import FeedItem, encode_feed_data

FRAME_COST = 72
"""Bytes one cached feed frame takes in memory (a 30-byte bytes object in a deque;
measured)."""

DATA_ENTRY_OVERHEAD = 230
"""Bytes one data cache entry takes besides its data (bytes object, tuple, checksum int,
ordered-dict slot; measured): the cache bounds its real memory, not just the payload."""


class FeedCache:
    """The FeedData frames of the most recent committed transactions, a contiguous id
    range, bounded in bytes.

    Each committed transaction's frame is encoded once, when it commits, and the same
    bytes go to every client's feed (the frame is the same for every connection).
    Feeds of clients near the head read from here; older positions fall back to
    storage. Bytes objects are not tracked by the cyclic garbage collector: a cache of
    a million frames adds nothing to a collection's pause.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_frames = max(1, max_bytes // FRAME_COST)
        self._frames: collections.deque[bytes] = collections.deque()
        self._first = 0
        """The transaction id of ``_frames[0]``."""
        self.hits = 0
        self.misses = 0

    @property
    def first_id(self) -> int | None:
        return self._first if self._frames else None

    @property
    def last_id(self) -> int | None:
        return self._first + len(self._frames) - 1 if self._frames else None

    def __len__(self) -> int:
        return len(self._frames)

    def add(self, records: Sequence[FeedItem]) -> None:
        """The transactions ``records`` (dense, ascending) committed: cache their frames."""
        if not records:
            return
        frames = self._frames
        first = records[0].transaction_id
        if not frames or first != self._first + len(frames):
            frames.clear()  # keep the range contiguous
            self._first = first
        frames.extend(encode_feed_data(records))
        excess = len(frames) - self.max_frames
        if excess > 0:
            for _ in range(excess):
                frames.popleft()
            self._first += excess

    def clear(self) -> None:
        self._frames.clear()

    def frames(self, start: int, max_count: int) -> list[bytes]:
        """The frames of the transactions from ``start`` (at most ``max_count``) when the
        cache holds ``start``, else []."""
        frames = self._frames
        offset = start - self._first
        size = len(frames)
        if not frames or offset < 0 or offset >= size:
            self.misses += 1
            return []
        self.hits += 1
        end = min(size, offset + max_count)
        if offset >= size // 2:
            # near the head, where feeds usually are: walk from the right end
            taken = list(itertools.islice(reversed(frames), size - end, size - offset))
            taken.reverse()
            return taken
        return list(itertools.islice(frames, offset, end))


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
