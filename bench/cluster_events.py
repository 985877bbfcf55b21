"""Cluster manager events and preferred partitions: figures (never pass/fail).

1. ``PartitionEvents``: a burst of gains and losses on P partitions with no
   consumer: pending events (bounded by 2 x P), the structure's memory
   (tracemalloc), and the cost per change and per event read.
2. Preferred partition moves on the embedded ``local`` coordination (a real
   SQLite file): 2 servers (cluster managers) on P partitions; the time from an
   operator override (the same call ``waltz server add-preferred-partition``
   makes) until the partition is held by the preferred server, p50/p99.

    .venv/bin/python bench/cluster_events.py [--partitions 64] [--changes 200000] [--moves 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.cluster_manager import (
    ClusterManager,
    LossReason,
    PartitionEvent,
    PartitionEvents,
    PartitionGained,
    PartitionLost,
)
from waltz_server.server.preferred import PreferredPartitionStore


def _burst(ops: list[int], sink: Callable[[PartitionEvent], object]) -> None:
    held: dict[int, int] = {}
    generation: dict[int, int] = {}
    for p in ops:
        if p in held:
            sink(PartitionLost(p, held.pop(p), 1, LossReason.MOVED))
        else:
            generation[p] = generation.get(p, 0) + 1
            held[p] = generation[p]
            sink(PartitionGained(p, held[p], 1))


def _traced(build: Callable[[], object]) -> float:
    """KiB still allocated by what ``build`` returns (tracemalloc)."""
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    kept = build()
    size = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    del kept
    return size / 1024


def bench_events(partitions: int, changes: int) -> None:
    rng = random.Random(7)
    ops = [rng.randrange(partitions) for _ in range(changes)]
    events = PartitionEvents()
    started = time.perf_counter()
    _burst(ops, events.put)
    per_change = (time.perf_counter() - started) / changes
    pending = events.qsize()
    started = time.perf_counter()
    while not events.empty():
        events.get_nowait()
    per_read = (time.perf_counter() - started) / max(pending, 1)

    def coalesced() -> object:
        kept = PartitionEvents()
        _burst(ops, kept.put)
        return kept

    def unbounded() -> object:  # what the asyncio.Queue of every event held before
        kept: asyncio.Queue[PartitionEvent] = asyncio.Queue()
        _burst(ops, kept.put_nowait)
        return kept

    print(
        f"PartitionEvents     {changes} changes on {partitions} partitions, no reader: "
        f"peak {events.peak} pending (bound {2 * partitions}), "
        f"{_traced(coalesced):.1f} KiB (a queue of every event: {_traced(unbounded):.0f} KiB); "
        f"{per_change * 1e6:.2f} us per change, {per_read * 1e6:.2f} us per event read"
    )


async def bench_preferred(partitions: int, moves: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        uri = f"local://{directory}?root=/bench"

        def new() -> Coordination:
            return coordination_from_uri(uri, {"session_timeout": 5.0})

        admin_client = new()
        await admin_client.start()
        admin = ClusterAdmin(admin_client)
        await admin.create_cluster(
            num_partitions=partitions, num_replicas=1, storage_nodes=["127.0.0.1:7001"]
        )
        a = ClusterManager(new, "tcp://127.0.0.1/a")
        b = ClusterManager(new, "tcp://127.0.0.1/b")
        store = PreferredPartitionStore(admin_client)
        latencies: list[float] = []
        try:
            await a.start()
            await b.start()
            for _ in range(3000):  # until the two share the partitions
                if len(a.owned) + len(b.owned) == partitions and len(b.owned) > 1:
                    break
                await asyncio.sleep(0.01)
            for _ in range(moves):
                # b prefers one of a's partitions (the previous one is balanced again).
                partition = min(a.owned)
                started = time.perf_counter()
                await store.change("tcp://127.0.0.1/b", lambda _, p=partition: [p])  # type: ignore[misc]
                deadline = started + 30
                while partition not in b.owned:
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"partition {partition} did not move")
                    await asyncio.sleep(0.001)
                latencies.append(time.perf_counter() - started)
        finally:
            await b.stop()
            await a.stop()
            await admin_client.close()
    latencies.sort()
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[max(0, int(len(latencies) * 0.99) - 1)] * 1e3
    print(
        f"preferred move      local coordination, {partitions} partitions, 2 servers, "
        f"{moves} overrides: override -> held by the preferred server p50 {p50:.1f} ms, "
        f"p99 {p99:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--moves", type=int, default=30)
    args = parser.parse_args()
    bench_events(args.partitions, args.changes)
    asyncio.run(bench_preferred(args.partitions, args.moves))


if __name__ == "__main__":
    main()
