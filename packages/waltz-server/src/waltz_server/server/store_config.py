"""The store layer's configuration and the interfaces a store session is given: its
tuning (``[server.store]``), the partition's archive as the store sees it, and the
listeners of commits and recoveries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from waltz_api.types import Record


@dataclass(frozen=True)
class StoreConfig:
    """Tuning of the store layer (``[server.store]``)."""

    max_batch_records: int = 512
    max_batch_bytes: int = 4 * 1024 * 1024
    max_pending_records: int = 8192
    """Appends not yet committed before ``append`` waits (back pressure)."""
    max_window_bytes: int = 32 * 1024 * 1024
    """Bytes of recent records kept in memory for lagging replicas; older ones are read
    back from a healthy replica's storage."""
    catch_up_batch: int = 256
    max_inflight_batches: int = 4
    """Append batches in flight to one replica at once (its storage node groups
    consecutive ones into one flush)."""
    checkpoint_interval: int = 250_000
    """A new session (so a short recovery) once this many transactions were written."""
    idle_probe_interval: float = 2.0
    """An idle replica is asked its max transaction id this often: a storage node that
    died (or a session that was fenced) while nothing was written is noticed."""
    retry_initial: float = 0.05
    retry_max: float = 2.0
    drain_timeout: float = 10.0


class ArchiveLink(Protocol):
    """The partition's archive, as the store sees it (``waltz_server.server.archiving``)."""

    @property
    def mark(self) -> int:
        """The archive mark as last known: every id at or below it is archived (-1:
        none)."""

    async def refresh(self) -> int:
        """Read the archive mark from the cluster metadata (CoordinationError: the
        service is unreachable)."""

    async def read(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        """Archived records from ``start`` (ArchiveError when the archive fails)."""


CommitListener = Callable[[int, Sequence[Record]], None]
"""``listener(high_water_mark, records)``: ``records`` are the newly committed ones, in order."""
RecoveryListener = Callable[[int], None]


__all__ = ["ArchiveLink", "CommitListener", "RecoveryListener", "StoreConfig"]
