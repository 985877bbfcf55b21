"""``exact``: a dictionary lock table with no false positives.

It remembers the last WRITE/APPEND transaction id of every lock hash since the
last reset; a hash never recorded estimates the reset high-water mark. Memory
grows with the number of distinct locks recorded between resets (about 100
bytes each), so choose it when the set of locks is bounded or false positives
are costly.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from waltz_api.contracts import LockTable
from waltz_api.types import NO_TRANSACTION, LockRequest
from waltz_server.locktables._options import check_high_water_mark, check_option_names

_OPTIONS: frozenset[str] = frozenset()


class ExactLockTable(LockTable):
    """Exact last-change ids per lock hash. Options: none."""

    def __init__(
        self, high_water_mark: int = NO_TRANSACTION, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(high_water_mark, options)
        check_option_names("exact", self.options, _OPTIONS)
        self._floor = check_high_water_mark(high_water_mark)
        self._last: dict[int, int] = {}

    def estimate(self, request: LockRequest) -> int:
        last = self._last
        floor = self._floor
        result = NO_TRANSACTION
        for lock_hash in request.read:
            value = last.get(lock_hash, floor)
            if value > result:
                result = value
        for lock_hash in request.write:
            value = last.get(lock_hash, floor)
            if value > result:
                result = value
        return result

    def record(self, request: LockRequest, transaction_id: int) -> None:
        last = self._last
        floor = self._floor
        for group in (request.write, request.append):
            for lock_hash in group:
                # max(): an id below what is known (out of order) must not lower it.
                if transaction_id > last.get(lock_hash, floor):
                    last[lock_hash] = transaction_id

    def reset(self, high_water_mark: int) -> None:
        self._floor = check_high_water_mark(high_water_mark)
        self._last.clear()

    def stats(self) -> Mapping[str, Any]:
        return {
            "entries": len(self._last),
            "reset_high_water_mark": self._floor,
            "high_water_mark": max(self._last.values(), default=self._floor),
            "memory_bytes": sys.getsizeof(self._last),
        }
