"""A cluster manager's partition events: what a server gained and lost, in order, for
its consumer (the server opening and closing partitions).

:class:`PartitionEvents` is bounded and coalescing: however fast the assignment
churns, at most two events per partition wait (see its docstring). Split from
:mod:`waltz_server.server.cluster_manager`, which produces them.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


class LossReason(enum.Enum):
    """Why a server stopped holding a partition."""

    MOVED = "moved"
    """The leader assigned it to another server (or to this one at a newer generation)."""
    SESSION_LOST = "session_lost"
    """This server's coordination session expired: everything it held is gone."""
    STOPPED = "stopped"
    """The cluster manager was stopped."""


@dataclass(frozen=True, slots=True)
class PartitionGained:
    """This server now serves ``partition_id`` at ``generation``: open it (start a
    store session with this generation; requests carrying another generation are refused)."""

    partition_id: int
    generation: int
    server_id: int


@dataclass(frozen=True, slots=True)
class PartitionLost:
    """This server no longer serves ``partition_id`` (held at ``generation``): close it."""

    partition_id: int
    generation: int
    server_id: int
    reason: LossReason


PartitionEvent = PartitionGained | PartitionLost
EventHandler = Callable[[PartitionEvent], Awaitable[None]]


class PartitionEvents:
    """A manager's gains and losses for its consumer: bounded, coalescing, in order.

    Not a queue of every change: it keeps what the manager holds and what the
    consumer has been told it holds (partition -> generation and server id), and
    hands out the events that take the consumer from the second to the first.
    A partition that changes many times before the consumer looks yields at most
    two events (the loss of what the consumer was told, the gain of what is held
    now), so its size is at most twice the number of partitions however long the
    consumer is away or however fast the assignment churns.

    Order: every pending loss comes before every pending gain (closing early and
    opening late are both safe), each in the order the partitions first changed;
    for one partition a :class:`PartitionLost` always ends the
    :class:`PartitionGained` the consumer got before it, at that generation, with
    the reason of the first loss since.

    The consumer side mirrors ``asyncio.Queue``: :meth:`get`, :meth:`get_nowait`
    (``asyncio.QueueEmpty`` when nothing is pending), :meth:`empty`, :meth:`qsize`.
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, int]] = {}  # partition -> (generation, server id)
        self._told: dict[int, tuple[int, int]] = {}
        # Insertion-ordered: the order in which the partitions first changed.
        self._losses: dict[int, None] = {}
        self._gains: dict[int, None] = {}
        self._reasons: dict[int, LossReason] = {}  # the first loss since the consumer's gain
        self._wakeup = asyncio.Event()
        self._closed = False
        self.peak = 0
        """The most events ever pending at once (for tests and figures)."""

    def put(self, event: PartitionEvent) -> None:
        """Record a change of what the manager holds (never blocks, never grows past
        two entries per partition)."""
        partition = event.partition_id
        if isinstance(event, PartitionGained):
            self._held[partition] = (event.generation, event.server_id)
        else:
            self._held.pop(partition, None)
            if partition in self._told:
                self._reasons.setdefault(partition, event.reason)
        self._refresh(partition)
        self.peak = max(self.peak, self.qsize())
        self._wakeup.set()

    def _refresh(self, partition: int) -> None:
        told, held = self._told.get(partition), self._held.get(partition)
        if told is not None and told != held:
            self._losses.setdefault(partition, None)
        else:
            self._losses.pop(partition, None)
            self._reasons.pop(partition, None)
        if held is not None and told != held:
            self._gains.setdefault(partition, None)
        else:
            self._gains.pop(partition, None)

    def qsize(self) -> int:
        """How many events are pending (at most twice the number of partitions)."""
        return len(self._losses) + len(self._gains)

    def empty(self) -> bool:
        return not self._losses and not self._gains

    def get_nowait(self) -> PartitionEvent:
        """The next event; ``asyncio.QueueEmpty`` when none is pending."""
        if self._losses:
            partition = next(iter(self._losses))
            del self._losses[partition]
            generation, server_id = self._told.pop(partition)
            reason = self._reasons.pop(partition, LossReason.MOVED)
            self._refresh(partition)
            return PartitionLost(partition, generation, server_id, reason)
        if self._gains:
            partition = next(iter(self._gains))
            del self._gains[partition]
            self._told[partition] = held = self._held[partition]
            return PartitionGained(partition, held[0], held[1])
        raise asyncio.QueueEmpty

    async def get(self) -> PartitionEvent:
        """Wait for the next event."""
        while self.empty():
            self._wakeup.clear()
            await self._wakeup.wait()
        return self.get_nowait()

    async def next_or_none(self) -> PartitionEvent | None:
        """The next event, or None once :meth:`close` was called and nothing is pending."""
        while self.empty():
            if self._closed:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()
        return self.get_nowait()

    def close(self) -> None:
        """No more changes come: :meth:`next_or_none` returns None once drained."""
        self._closed = True
        self._wakeup.set()
