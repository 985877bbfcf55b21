"""Scrubbing on a storage node: its partitions' sealed records read back and verified.

The node's :class:`Scrubber` (config ``[storage.scrub]``) makes a pass over every hosted
partition every ``interval`` seconds: one engine call at a time
(``StoragePartition.scrub``, capability ``scrub``), each run in the partition's order
between its requests (``PartitionWorker.run_in_order``: calls of one partition are
issued by one task at a time, the engine contract), reading at most ``CHUNK_BYTES`` and
paced by :class:`Pacer` so that the record bytes read never run ahead of
``rate_bytes_per_second``. ``waltz storage scrub`` runs a pass at once, on a running
node (the admin command ``scrub``) or on a stopped node's data directory
(:func:`scrub_engine`).

Damage found: the engine moves the damaged bytes aside and reports the range missing,
as its start-up recovery does. The node then closes the connections that serve that
partition (:meth:`StorageNode.end_sessions`): the server's replica task of the store
session leaves and rejoins, and a rejoin copies the replica's missing ranges from the
other writers before it writes again; without a running session, the next session's
recovery repairs them before the replica votes. Until then reads of the range fail
naming it (the server reads from another replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from waltz_api.contracts.storage import ScrubProgress, StorageEngine
from waltz_api.errors import PartitionClosedError, StorageError

if TYPE_CHECKING:
    from waltz_storage_node.metrics import StorageNodeMetrics
    from waltz_storage_node.partition import PartitionWorker


class ScrubbedNode(Protocol):
    """What a scrub uses of its node (:class:`~waltz_storage_node.node.StorageNode`;
    the node and its admin commands make scrubbers, so this module does not import them)."""

    @property
    def engine(self) -> StorageEngine: ...

    @property
    def metrics(self) -> StorageNodeMetrics | None: ...

    def hosted_workers(self) -> dict[int, PartitionWorker]: ...

    def worker_of(self, partition_id: int) -> PartitionWorker: ...

    async def end_sessions(self, partition_id: int, why: str) -> int: ...


log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Most record bytes one engine call reads (less when the rate is lower)."""

Step = Callable[[int, int], Awaitable[ScrubProgress]]
"""One engine call of a partition's pass: ``(start, max_bytes) -> progress``."""


class Pacer:
    """Keeps the bytes read within ``rate`` bytes per second (None: no bound): after
    reading ``n`` bytes, :meth:`spent` waits until the reading is within the rate again.
    Time idle is not saved up: after a pause the rate holds from the pause's end."""

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self._free_at: float | None = None

    @property
    def chunk(self) -> int:
        """The budget of one engine call."""
        return CHUNK_BYTES if self.rate is None else max(1, min(self.rate, CHUNK_BYTES))

    async def spent(self, n: int) -> None:
        if self.rate is None or n <= 0:
            return
        now = asyncio.get_running_loop().time()
        free_at = max(self._free_at if self._free_at is not None else now, now)
        self._free_at = free_at + n / self.rate
        if self._free_at > now:
            await asyncio.sleep(self._free_at - now)


@dataclass
class PartitionScrub:
    """One pass over one partition."""

    partition_id: int
    records: int = 0
    bytes_read: int = 0
    damaged: list[tuple[int, int]] = field(default_factory=list)
    complete: bool = False
    """The pass reached the end of the sealed records."""
    error: str | None = None
    """Why it stopped early (the partition closed, removed, unavailable...)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "partition_id": self.partition_id,
            "records": self.records,
            "bytes": self.bytes_read,
            "damaged": [list(r) for r in self.damaged],
            "complete": self.complete,
            "error": self.error,
        }


async def scrub_partition(
    partition_id: int,
    step: Step,
    pacer: Pacer,
    on_progress: Callable[[ScrubProgress], Awaitable[None]] | None = None,
) -> PartitionScrub:
    """One pass over a partition, ``step`` by ``step``; a storage error ends it early
    (in ``error``)."""
    result = PartitionScrub(partition_id)
    start: int | None = 0
    while start is not None:
        try:
            progress = await step(start, pacer.chunk)
        except StorageError as exc:
            result.error = str(exc)
            return result
        result.records += progress.records
        result.bytes_read += progress.bytes_read
        result.damaged.extend(progress.damaged)
        if on_progress is not None:
            await on_progress(progress)
        await pacer.spent(progress.bytes_read)
        if progress.next_start is not None and progress.next_start <= start:
            result.error = f"the engine's scrub did not advance past {start}"
            return result
        start = progress.next_start
    result.complete = True
    return result


def damage_line(partition_id: int, damaged: Iterable[tuple[int, int]]) -> str:
    ranges = ", ".join(f"{a}..{b}" for a, b in damaged)
    return (
        f"partition {partition_id}: the scrub found transactions {ranges} damaged: moved "
        "aside, missing until repaired from a peer"
    )


class Scrubber:
    """The node's scrub: background passes, and passes on request (see the module)."""

    def __init__(
        self,
        node: ScrubbedNode,
        *,
        rate_bytes_per_second: int | None,
        interval: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.rate = rate_bytes_per_second
        self.interval = interval
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        """Background passes completed."""
        self.last_pass: list[PartitionScrub] = []

    def start(self) -> None:
        if self._task is None:
            metrics = self.node.metrics
            if metrics is not None:
                metrics.scrub_partitions(self.node.hosted_workers())
            self._task = asyncio.create_task(self._run(), name="storage-scrub")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        pacer = Pacer(self.rate)  # one for every pass: the rate holds across them
        while True:
            started = loop.time()
            try:
                self.last_pass = await self.run_pass(pacer=pacer)
                self.passes += 1
            except Exception:  # a bug must not end scrubbing for the node's life
                log.exception("a scrub pass failed; the next one starts in %ss", self.interval)
            await asyncio.sleep(max(0.0, started + self.interval - loop.time()))

    async def run_pass(
        self, partitions: Iterable[int] | None = None, *, pacer: Pacer | None = None
    ) -> list[PartitionScrub]:
        """Scrub ``partitions`` (every hosted one when None) once, one after another."""
        node = self.node
        everything = partitions is None
        ids = sorted(node.hosted_workers()) if partitions is None else list(partitions)
        pacer = pacer if pacer is not None else Pacer(self.rate)
        if node.metrics is not None:
            node.metrics.scrub_partitions(ids)
        loop = asyncio.get_running_loop()
        started = loop.time()  # the loop's clock: a simulation's replay prints the same
        results = []
        for partition_id in ids:
            results.append(await self._scrub(partition_id, pacer))
        if everything and node.metrics is not None:
            node.metrics.scrub_pass_completed(self._clock())
        damaged = [f"{a}..{b} of {r.partition_id}" for r in results for a, b in r.damaged]
        stopped = [f"{r.partition_id} ({r.error})" for r in results if r.error]
        log.log(
            logging.WARNING if damaged or stopped else logging.INFO,
            "scrub pass over %d partition(s): %d records (%d bytes) verified in %.1fs; "
            "damaged: %s; not finished: %s",
            len(results),
            sum(r.records for r in results),
            sum(r.bytes_read for r in results),
            loop.time() - started,
            ", ".join(damaged) or "none",
            ", ".join(stopped) or "none",
        )
        return results

    async def _scrub(self, partition_id: int, pacer: Pacer) -> PartitionScrub:
        node = self.node

        async def step(start: int, max_bytes: int) -> ScrubProgress:
            worker = node.worker_of(partition_id)
            if not worker.available:
                raise PartitionClosedError(
                    f"partition {partition_id} is marked unavailable: not scrubbed"
                )

            async def call() -> ScrubProgress:
                progress: ScrubProgress = await node.engine.partition(partition_id).scrub(
                    start, max_bytes
                )
                return progress

            progress: ScrubProgress = await worker.run_in_order(call)
            return progress

        async def on_progress(progress: ScrubProgress) -> None:
            damaged = sum(b - a + 1 for a, b in progress.damaged)
            if node.metrics is not None:
                node.metrics.scrubbed(partition_id, progress.records, progress.bytes_read, damaged)
            if progress.damaged:
                line = damage_line(partition_id, progress.damaged)
                log.error("%s", line)
                await node.end_sessions(partition_id, line)

        result = await scrub_partition(partition_id, step, pacer, on_progress)
        log.debug(
            "partition %d: scrubbed %d records (%d bytes)%s",
            partition_id,
            result.records,
            result.bytes_read,
            f"; stopped: {result.error}" if result.error else "",
        )
        return result


async def scrub_engine(
    engine: StorageEngine,
    partitions: Iterable[int] | None = None,
    *,
    rate_bytes_per_second: int | None = None,
) -> list[PartitionScrub]:
    """A pass over an engine that no node serves (a stopped node's data directory, opened
    by this process: ``waltz storage scrub --data-dir``)."""
    pacer = Pacer(rate_bytes_per_second)
    results = []
    for partition_id in sorted(engine.partition_ids()) if partitions is None else partitions:

        async def step(start: int, max_bytes: int, pid: int = partition_id) -> ScrubProgress:
            return await engine.partition(pid).scrub(start, max_bytes)

        async def on_progress(progress: ScrubProgress, pid: int = partition_id) -> None:
            if progress.damaged:
                log.error("%s", damage_line(pid, progress.damaged))

        results.append(await scrub_partition(partition_id, step, pacer, on_progress))
    return results
