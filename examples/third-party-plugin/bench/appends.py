"""Benchmark of the ``sqlite`` storage engine beside the built-in ``fs`` one.

Prints figures; never a pass/fail test. Both engines are found through the
plugin registry (so the installed wheel is what is measured)::

    python bench/appends.py [--dir DIR] [--seconds 2] [--engines sqlite,fs]

For each engine:

- durable appends of 100-byte records by one appender awaiting each append,
  at batches of 1 and 100: records/s, and the p50/p99 latency of one append;
- 8 partitions appending batches of 1 concurrently (group commit): records/s
  (and, for ``sqlite``, how many appends one SQLite commit carried);
- range reads (``read_records`` of 1000): records/s;
- the peak Python memory (tracemalloc) of the whole run and the peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import crc32c

from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.plugins import get_registry
from waltz_api.types import Record, ReqId

PAYLOAD = bytes(range(100))
CHECKSUM = crc32c.crc32c(PAYLOAD)
REQ = ReqId(1, 1, 0, 0)


def batch_of(first: int, count: int) -> list[Record]:
    return [Record(t, REQ, 0, PAYLOAD, CHECKSUM) for t in range(first, first + count)]


async def open_engine(name: str, location: Path, partitions: int) -> StorageEngine:
    engine_class: Any = get_registry().get("storage", name).factory
    engine: StorageEngine = await engine_class.open(
        str(location), cluster_key=uuid.uuid4(), num_partitions=partitions
    )
    return engine


async def one_appender(part: StoragePartition, batch: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        first = part.max_transaction_id() + 1
        started = time.perf_counter()
        await part.append(batch_of(first, batch))
        latencies.append(time.perf_counter() - started)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_engine(name: str, directory: Path, seconds: float) -> None:
    engine = await open_engine(name, directory / name, partitions=8)
    try:
        parts = [await engine.add_partition(pid) for pid in range(8)]
        for batch in (1, 100):
            latencies = await one_appender(parts[0], batch, seconds)
            rate = batch * len(latencies) / sum(latencies)
            print(
                f"{name:7} append batch {batch:>3}: {rate:>10,.0f} records/s  "
                f"p50 {statistics.median(latencies) * 1e3:6.2f} ms  "
                f"p99 {percentile(latencies, 0.99) * 1e3:6.2f} ms"
            )
        before = dict(getattr(engine, "stats", dict)())
        started = time.perf_counter()
        counts = await asyncio.gather(*(one_appender(p, 1, seconds) for p in parts[1:]))
        elapsed = time.perf_counter() - started
        total = sum(len(c) for c in counts)
        line = f"{name:7} 7 partitions, batch 1: {total / elapsed:>10,.0f} records/s"
        after = dict(getattr(engine, "stats", dict)())
        if "commits" in after:
            commits = max(1, after["commits"] - before["commits"])
            per_commit = (after["changes"] - before["changes"]) / commits
            line += f"  ({per_commit:.1f} appends per commit)"
        print(line)
        top = parts[0].max_transaction_id()
        started = time.perf_counter()
        read = 0
        while read <= top:
            read += len(await parts[0].read_records(read, 1000))
        rate = read / (time.perf_counter() - started)
        print(f"{name:7} range reads of 1000: {rate:>10,.0f} records/s")
    finally:
        await engine.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--engines", default="sqlite,fs", help="storage plugin names")
    args = parser.parse_args()
    tracemalloc.start()
    with tempfile.TemporaryDirectory(prefix="waltz-sqlite-bench-", dir=args.dir) as directory:
        for name in args.engines.split(","):
            await bench_engine(name, Path(directory), args.seconds)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak Python memory {peak / 2**20:.1f} MiB, peak RSS {rss / 1024:.1f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
