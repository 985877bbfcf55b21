"""What the fs engine's readers see of a partition: its durable segments, published by
the committer (an immutable snapshot: a read uses one from start to end)."""

from __future__ import annotations

from dataclasses import dataclass

from waltz_api.types import NO_TRANSACTION


@dataclass(frozen=True, slots=True)
class SegView:
    """What readers see of a segment: only durable records."""

    first: int
    count: int
    end: int
    data_fd: int
    index_fd: int
    created_ms: int = -1


@dataclass(frozen=True, slots=True)
class View:
    segments: tuple[SegView, ...]
    max_txid: int
    missing: tuple[tuple[int, int], ...] = ()
    start: int = 0
    """The first id kept (below it: dropped, archived elsewhere)."""


EMPTY_VIEW = View((), NO_TRANSACTION)
