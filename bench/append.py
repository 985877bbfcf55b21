"""Benchmark of the whole write path: committed transactions/s and commit latency.

Real processes: a ZooKeeper, three ``waltz storage`` nodes (fs engine, real
fsync), one ``waltz server``, all over ZeroMQ on loopback; this process is the
client (a raw protocol client: appends pipelined on one connection per
partition, the commit observed in the feed). Prints figures; never a
pass/fail test. Usage::

    python bench/append.py [--seconds 5] [--window 1000] [--rate 5000]

Runs, each for ``--seconds``:

- 1 partition and 4 partitions, without and with a WRITE lock per transaction
  (random among 100,000 entities, built on the latest high-water mark the
  client saw), as fast as the window of outstanding appends allows;
- 1 partition at a fixed ``--rate`` (transactions/s), for the latency at load.

For each: committed transactions/s, p50/p99/max commit latency (append sent ->
its FeedData received), lock failures, the server's peak RSS (VmHWM), and the CPU
microseconds per committed transaction of the server, of the three storage nodes
together and of this client (the steady figures on a loaded machine), and how many
records a storage append request carried on average (on the first storage node).
``--py-spy DIR`` records every process with py-spy during each run and prints where
their samples fall.
Data: 100 bytes per transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from process_cluster import peak_rss_mb, process_cluster
from profiling import CpuMeter, Spy

from waltz_api import wire
from waltz_api.cluster import ClusterMetadata
from waltz_api.contracts.transport import Transport
from waltz_api.messages import (
    AppendRequest,
    FeedData,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    MountRequest,
    MountResponse,
    MountStatus,
)
from waltz_api.types import Lock, LockRequest, ReqId
from waltz_server.server.testing import RawClient

DATA = bytes(range(100))
CHECKSUM = wire.checksum(DATA)


@dataclass
class Lane:
    """One partition's pipelined appender and feed reader."""

    client: RawClient
    partition: int
    generation: int
    client_id: int
    locks: bool
    rng: random.Random
    sent_at: dict[ReqId, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    committed: int = 0
    lock_failures: int = 0
    high_water_mark: int = -1
    seen: int = 0
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def request(self) -> AppendRequest:
        rid = ReqId(self.client_id, self.generation, self.partition, next(self.seq))
        locks = LockRequest()
        if self.locks:
            locks = LockRequest.from_locks([Lock("account", self.rng.randrange(100_000))])
        self.sent_at[rid] = time.perf_counter()
        return AppendRequest(rid, self.high_water_mark, locks, 0, DATA, CHECKSUM)

    def consume(self) -> None:
        now = time.perf_counter()
        received = self.client.received
        for message in received[self.seen :]:
            if isinstance(message, FeedData):
                self.high_water_mark = message.transaction_id
                sent = self.sent_at.pop(message.req_id, None)
                if sent is not None:
                    self.latencies.append(now - sent)
                    self.committed += 1
            elif isinstance(message, LockFailure):
                self.sent_at.pop(message.req_id, None)
                self.lock_failures += 1
        # keep memory flat over long runs
        del received[:]
        self.seen = 0

    @property
    def outstanding(self) -> int:
        return len(self.sent_at)


async def open_lanes(
    transport: Transport, metadata: ClusterMetadata, partitions: int, locks: bool, tag: int
) -> list[Lane]:
    lanes = []
    for partition in range(partitions):
        owner = (await metadata.partition_assignment(partition)).value
        client = await RawClient.connect(transport, owner.endpoint, f"bench:{tag}")
        client_id = 1000 * tag + partition
        # start the feed at the partition's current mark (no replay of earlier runs)
        await client.send(HighWaterMarkRequest(ReqId(client_id, owner.generation, partition, 0)))
        mark = (await client.wait(HighWaterMarkResponse, timeout=60))[0].transaction_id
        await client.send(MountRequest(ReqId(client_id, owner.generation, partition, 1), mark, 1))
        response = (await client.wait(MountResponse, timeout=60))[0]
        lane = Lane(client, partition, owner.generation, client_id, locks, random.Random(tag))
        assert response.status is MountStatus.READY, response
        lane.high_water_mark = response.high_water_mark
        client.received.clear()
        lanes.append(lane)
    return lanes


async def drive(
    lanes: list[Lane], seconds: float, window: int, rate: float | None
) -> tuple[float, list[float], int]:
    start = time.perf_counter()
    deadline = start + seconds
    sent = 0
    while time.perf_counter() < deadline:
        for lane in lanes:
            lane.consume()
        if rate is None:
            for lane in lanes:
                burst = [lane.request() for _ in range(max(0, window - lane.outstanding))]
                for request in burst:
                    await lane.client.send(request)
        else:
            due = int((time.perf_counter() - start) * rate) - sent
            for i in range(due):
                lane = lanes[i % len(lanes)]
                await lane.client.send(lane.request())
            sent += max(due, 0)
        await lanes[0].client.changed(0.001)
    # let the pipeline drain
    drain_deadline = time.perf_counter() + 10
    while any(lane.outstanding for lane in lanes) and time.perf_counter() < drain_deadline:
        for lane in lanes:
            lane.consume()
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - start
    committed = sum(lane.committed for lane in lanes)
    latencies = [x for lane in lanes for x in lane.latencies]
    failures = sum(lane.lock_failures for lane in lanes)
    return committed / seconds if rate is None else committed / elapsed, latencies, failures


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def main(args: argparse.Namespace) -> None:
    async with process_cluster(4, args.server_option) as cluster:
        print(
            f"cluster: ZooKeeper, 3 storage nodes (fs, fsync), 1 server, zmq; data 100 B; "
            f"window {args.window} outstanding appends per partition"
        )
        print(
            f"{'run':<34} {'tx/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
            f"{'lock fail':>9} {'server RSS MB':>13} {'CPU us/tx: server':>17} {'storage':>7} "
            f"{'client':>6} {'records/storage append':>22}"
        )
        pids = cluster.pids()
        meter = CpuMeter(
            {
                "server": [pids["server"]],
                "storage": [v for k, v in pids.items() if k != "server"],
                "client": [os.getpid()],
            }
        )
        runs = [
            ("1 partition, no locks", 1, False, None),
            ("1 partition, WRITE lock", 1, True, None),
            ("4 partitions, no locks", 4, False, None),
            ("4 partitions, WRITE lock", 4, True, None),
            (f"1 partition at {args.rate:.0f} tx/s", 1, False, args.rate),
        ]
        if args.only_rate:
            runs = runs[-1:]
        if args.runs:
            runs = [runs[int(i)] for i in args.runs.split(",")]
        for tag, (name, partitions, locks, rate) in enumerate(runs):
            lanes = await open_lanes(cluster.transport, cluster.metadata, partitions, locks, tag)
            spy = Spy(args.py_spy, name, pids, gil=args.gil) if args.py_spy else None
            try:
                if spy is not None:
                    spy.start(args.seconds)
                counters = await cluster.storage_counters()
                meter.start()
                throughput, latencies, failures = await drive(
                    lanes, args.seconds, args.window, rate
                )
                meter.stop()
                after = await cluster.storage_counters()
            finally:
                for lane in lanes:
                    await lane.client.close()
            cpu = meter.per_transaction_us(sum(lane.committed for lane in lanes))
            records = after["records_appended"] - counters["records_appended"]
            requests = max(1, after["append_requests"] - counters["append_requests"])
            print(
                f"{name:<34} {throughput:>9.0f} {pct(latencies, 0.5):>8.2f} "
                f"{pct(latencies, 0.99):>8.2f} {max(latencies, default=0) * 1000:>8.2f} "
                f"{failures:>9} {peak_rss_mb(cluster.server.pid):>13.1f} "
                f"{cpu['server']:>17.0f} {cpu['storage']:>7.0f} {cpu['client']:>6.0f} "
                f"{records / requests:>22.1f}"
            )
            if spy is not None:
                spy.stop()
                print(spy.report())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=5000.0)
    parser.add_argument(
        "--server-option",
        action="append",
        default=[],
        help="a line of the server's [server] config section, e.g. 'data_cache_bytes = 1048576'",
    )
    parser.add_argument("--only-rate", action="store_true", help="run the fixed-rate run only")
    parser.add_argument("--runs", help="comma-separated indexes of the runs to make (0-4)")
    parser.add_argument(
        "--py-spy", type=Path, help="record each process with py-spy into this directory"
    )
    parser.add_argument(
        "--gil", action="store_true", help="py-spy: only samples holding the GIL (CPU time)"
    )
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parser.parse_args()))
