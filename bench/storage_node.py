"""Storage node throughput and latency over a transport, end to end.

A storage node runs in this process (its own event loop thread would only add
noise on 2 cores: node and client share one loop, like a server and a
co-located node would not; the figures are therefore a lower bound for the
node). The client pipelines appends of ``--batch`` records (``--size`` bytes
each) to ``--partitions`` partitions with ``--inflight`` requests in flight per
partition, then range-reads everything back. Prints appended records/s, MB/s,
append latency p50/p99, the process's CPU per append request (the node's and the
client's, every thread), range-read records/s, and peak RSS. Never pass/fail.

With the fs engine and the zmq transport it also prints the messages per round: the
transport messages the node sent (a burst of frames to one peer in one loop iteration
is one message, ``KIND_BATCH``) per flush of the engine (at feature level 3 a round is
one journal flush for every partition), and the records per engine append.

    .venv/bin/python bench/storage_node.py --transport memory --engine memory
    .venv/bin/python bench/storage_node.py --transport zmq --engine fs --data-dir /tmp/x
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from waltz_api.contracts.storage import StorageEngine
from waltz_api.contracts.transport import Transport
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_conformance.records import make_records
from waltz_storage_node import StorageClient, StorageNode

CLUSTER_KEY = uuid.uuid4()


async def _engine(name: str, location: str, partitions: int) -> StorageEngine:
    if name == "memory":
        from waltz_conformance.reference.storage import MemoryStorageEngine

        factory: Any = MemoryStorageEngine
    else:
        factory = get_registry().get("storage", name).factory
    engine: StorageEngine = await factory.open(
        location, cluster_key=CLUSTER_KEY, num_partitions=partitions
    )
    for p in range(partitions):
        await engine.add_partition(p)
    return engine


def _transport(name: str) -> Transport:
    transport: Transport = get_registry().get("transport", name).factory({})
    return transport


async def run(args: argparse.Namespace) -> None:
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="waltz-bench-node-")
    location = data_dir if args.engine != "memory" else f"bench-{uuid.uuid4()}"
    endpoint = (
        f"memory://bench-{uuid.uuid4()}"
        if args.transport == "memory"
        else f"tcp://127.0.0.1:{free_port()}"
    )
    engine = await _engine(args.engine, location, args.partitions)
    server_transport = _transport(args.transport)
    client_transport = _transport(args.transport)
    node = StorageNode(engine, server_transport, endpoint, max_append_batch_records=args.node_batch)
    await node.start()
    flushes = [0]
    if hasattr(engine, "fsync_observer"):
        engine.fsync_observer = lambda seconds: flushes.__setitem__(0, flushes[0] + 1)
    client = await StorageClient.connect(client_transport, node.endpoint, sender="bench")
    await client.open(CLUSTER_KEY, args.partitions)
    latencies: list[float] = []
    per_partition = args.records // args.partitions
    batches = [
        [
            make_records(
                start, min(args.batch, per_partition - start), partition_id=p, size=args.size
            )
            for start in range(0, per_partition, args.batch)
        ]
        for p in range(args.partitions)
    ]

    async def timed_append(p: int, records: list[Any]) -> None:
        t0 = time.perf_counter()
        await client.append(1, p, records)
        latencies.append(time.perf_counter() - t0)

    async def writer(p: int) -> None:
        queue = batches[p]
        for i in range(0, len(queue), args.inflight):
            await asyncio.gather(*(timed_append(p, b) for b in queue[i : i + args.inflight]))

    try:
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        await asyncio.gather(*(writer(p) for p in range(args.partitions)))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        total = per_partition * args.partitions
        lat = sorted(latencies)
        print(
            f"storage node, transport={args.transport} engine={args.engine} "
            f"partitions={args.partitions} batch={args.batch} size={args.size} "
            f"inflight={args.inflight} node-batch={args.node_batch}"
        )
        print(
            f"  append: {total / elapsed:,.0f} records/s, "
            f"{total * args.size / elapsed / 1e6:,.1f} MB/s, "
            f"{len(latencies) / elapsed:,.0f} requests/s, CPU {cpu / len(latencies) * 1e6:.0f} us "
            "per request (node and client, all threads)"
        )
        print(
            f"  append latency: p50 {statistics.median(lat) * 1e3:.2f} ms, "
            f"p99 {lat[int(len(lat) * 0.99) - 1] * 1e3:.2f} ms"
        )
        sent = _messages_sent(node)
        stats = [worker.stats for worker in node.hosted_workers().values()]
        engine_appends = sum(s.engine_appends for s in stats)
        if flushes[0] and sent is not None:
            print(
                f"  rounds (engine flushes): {flushes[0]}, node messages sent: {sent} "
                f"({sent / flushes[0]:.2f} per round), append requests per round "
                f"{sum(s.append_requests for s in stats) / flushes[0]:.2f}, records per "
                f"engine append {sum(s.records_appended for s in stats) / engine_appends:.1f}"
            )
        t1 = time.perf_counter()
        read = 0
        for p in range(args.partitions):
            start = 0
            while start < per_partition:
                got = await client.records(1, p, start, 2000)
                read += len(got)
                start += len(got)
        elapsed_read = time.perf_counter() - t1
        print(f"  range read: {read / elapsed_read:,.0f} records/s ({read} records)")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"  peak RSS (node + client + data in memory): {peak:,.0f} MiB")
    finally:
        await client.close()
        await node.close()
        await server_transport.close()
        await client_transport.close()
        if not args.data_dir and args.engine != "memory":
            shutil.rmtree(Path(data_dir), ignore_errors=True)


def _messages_sent(node: StorageNode) -> int | None:
    """The transport messages the node sent on its connections so far (the ZeroMQ
    connection's message sequence number; None with another transport)."""
    counts: list[int] = []
    for conn in node._connections:
        count = getattr(conn, "_seq_out", None)
        if not isinstance(count, int):
            return None
        counts.append(count)
    return sum(counts) if counts else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="memory")
    parser.add_argument("--engine", default="memory")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--records", type=int, default=40000)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument(
        "--node-batch",
        type=int,
        default=10000,
        help="most records the node merges into one engine append (1: no merging)",
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
