"""``hwm-array``: the fixed-size probabilistic lock table of the spec (the default).

An array of ``size`` high-water marks. Each lock hash selects three slots:
the three lowest digits of its stable 64-bit hash written in base ``size``
(``h % size``, ``h // size % size``, ``h // size**2 % size``). The hash is
uniform (BLAKE2b), so the digits are three nearly independent uniform slots
as long as ``size**3`` is well below 2**64: hence the 2**20 cap on ``size``.
That is also the cheapest derivation in CPython (a division of a 64-bit int
by a small one has a fast path). The estimate of a lock is the minimum of its
three slots. Recording a
WRITE or APPEND lock at transaction ``t`` raises its three slots to at least
``t``. A slot only ever holds an id that some lock mapped to it recorded (or
the reset high-water mark), and every slot of a recorded lock is at least
that lock's last id: so the estimate is never below the truth (no false
negative) and never above the table's own high-water mark (a caught-up client
always passes). Collisions make estimates too high: false positives, rarer
with a larger array.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from waltz_api.contracts import LockTable
from waltz_api.types import NO_TRANSACTION, LockRequest
from waltz_server.locktables._options import (
    check_high_water_mark,
    check_int_option,
    check_option_names,
)

DEFAULT_SIZE = 30_000
"""The spec's default number of slots per partition."""

MAX_SIZE = 1 << 20
"""The largest ``size`` (8 MiB of slots): above it the three slots of a lock would
no longer be independent digits of its 64-bit hash. A table needing more is
better served by ``exact``."""

HASH_FUNCTIONS = 3

_OPTIONS = frozenset({"size"})


class HwmArrayLockTable(LockTable):
    """The spec's lock table: ``size`` slots, 3 hash functions, estimate = min of the slots.

    Options: ``size`` (int, 1 to 2**20, default 30000).
    """

    def __init__(
        self, high_water_mark: int = NO_TRANSACTION, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(high_water_mark, options)
        check_option_names("hwm-array", self.options, _OPTIONS)
        self._size = check_int_option(
            "hwm-array", "size", self.options.get("size", DEFAULT_SIZE), minimum=1, maximum=MAX_SIZE
        )
        self._floor = check_high_water_mark(high_water_mark)
        # A list beats array('q') here: reading a list slot returns the stored int
        # object, where array('q') builds a new one on every read.
        self._slots: list[int] = [self._floor] * self._size

    @property
    def size(self) -> int:
        return self._size

    def slots_of(self, lock_hash: int) -> tuple[int, int, int]:
        """The three slot indexes of ``lock_hash`` (for tests and diagnostics)."""
        size = self._size
        rest = lock_hash // size
        return lock_hash % size, rest % size, rest // size % size

    def estimate(self, request: LockRequest) -> int:
        slots = self._slots
        size = self._size
        result = NO_TRANSACTION
        # The loops are written out (not a helper per lock) because this is the
        # append hot path: no call, tuple or generator per lock.
        for lock_hash in request.read:
            rest = lock_hash // size
            value = slots[lock_hash % size]
            other = slots[rest % size]
            if other < value:
                value = other
            other = slots[rest // size % size]
            if other < value:
                value = other
            if value > result:
                result = value
        for lock_hash in request.write:
            rest = lock_hash // size
            value = slots[lock_hash % size]
            other = slots[rest % size]
            if other < value:
                value = other
            other = slots[rest // size % size]
            if other < value:
                value = other
            if value > result:
                result = value
        return result

    def record(self, request: LockRequest, transaction_id: int) -> None:
        slots = self._slots
        size = self._size
        for group in (request.write, request.append):
            for lock_hash in group:
                rest = lock_hash // size
                index = lock_hash % size
                if slots[index] < transaction_id:
                    slots[index] = transaction_id
                index = rest % size
                if slots[index] < transaction_id:
                    slots[index] = transaction_id
                index = rest // size % size
                if slots[index] < transaction_id:
                    slots[index] = transaction_id

    def reset(self, high_water_mark: int) -> None:
        self._floor = check_high_water_mark(high_water_mark)
        self._slots[:] = [self._floor] * self._size

    def stats(self) -> Mapping[str, Any]:
        floor = self._floor
        return {
            "size": self._size,
            "hash_functions": HASH_FUNCTIONS,
            "high_water_mark": max(floor, *self._slots),
            "reset_high_water_mark": floor,
            "slots_above_reset": sum(1 for value in self._slots if value > floor),
            "memory_bytes": sys.getsizeof(self._slots),
        }
