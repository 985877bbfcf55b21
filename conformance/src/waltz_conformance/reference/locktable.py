"""The reference lock table: the exact model, kept deliberately simple."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waltz_api.contracts import LockTable
from waltz_api.types import NO_TRANSACTION, LockRequest


class MemoryLockTable(LockTable):
    """Remembers the last WRITE/APPEND transaction of every lock hash exactly.

    Hashes never recorded since the last reset estimate the reset's
    high-water mark. Memory grows with the number of distinct locks: this is
    the model the conformance suite checks other tables against, not a table
    to run in production.
    """

    def __init__(
        self, high_water_mark: int = NO_TRANSACTION, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(high_water_mark, options)
        self._floor = high_water_mark
        self._last: dict[int, int] = {}

    def estimate(self, request: LockRequest) -> int:
        estimate = NO_TRANSACTION
        for lock_hash in (*request.read, *request.write):
            estimate = max(estimate, self._last.get(lock_hash, self._floor))
        return estimate

    def record(self, request: LockRequest, transaction_id: int) -> None:
        for lock_hash in (*request.write, *request.append):
            self._last[lock_hash] = transaction_id

    def reset(self, high_water_mark: int) -> None:
        self._floor = high_water_mark
        self._last.clear()

    def stats(self) -> Mapping[str, Any]:
        return {"entries": len(self._last)}
