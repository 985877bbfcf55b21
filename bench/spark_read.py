"""Benchmark of the ``waltz`` Spark data source: rows/s of a batch read.

Prints figures; never a pass/fail test. Usage::

    SPARK_LOCAL_IP=127.0.0.1 python bench/spark_read.py [--transactions 1000000]
        [--partitions 2] [--data-size 100] [--split 250000] [--master local[2]]

A real cluster in this process (local coordination, 3 fs storage nodes, ZeroMQ, the
server); the log is written straight to the storage engines before the server starts
(``--transactions`` in all, spread over the partitions). Then, in the same run:

- the storage engine's raw range read (``read_records`` of 10000, in process), and
  ``read_block`` (the same records as one wire block, what a range read sends on);
- the wire: :class:`waltz_spark.LogReader` (RangeReadRequest loop, 3 in flight) from
  this process: ``read`` (records decoded) and ``read_blocks`` + the Arrow conversion
  an executor does (``waltz_spark.blocks``);
- Spark: ``spark.read.format("waltz")`` on ``--master``, a full scan
  (``count`` and the sum of the data lengths, so every column is produced),
  after a warm-up read of the first splits;
- peak RSS of this process (the driver; executors are Python workers of Spark).

Each in-process figure also gives the CPU seconds this process spent (the storage
nodes, the server and the reader share it; the machine's load average is printed too,
as other work on a shared machine slows every wall-clock figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class _Took:
    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def rate(self, count: int) -> str:
        return (
            f"{count / self.wall:12,.0f} records/s  ({self.wall:.2f} s, "
            f"{self.cpu / max(count, 1) * 1e6:.1f} us CPU of this process per record)"
        )


def _process_cpu() -> dict[str, float]:
    """CPU seconds so far of this process and of its live descendants, by kind (Linux
    /proc): "this process" (the cluster and the Spark driver), "JVM", "Python workers"
    (Spark's executors, reused between tasks)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry)
        parents[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
        names[pid] = name
    me = os.getpid()
    totals = {"this process": 0.0, "JVM": 0.0, "Python workers": 0.0}
    for pid, seconds in cpu.items():
        at, depth = pid, 0
        while at not in (me, 0, 1) and depth < 20:
            at, depth = parents.get(at, 0), depth + 1
        if pid == me:
            totals["this process"] += seconds
        elif at == me:
            totals["JVM" if names[pid] == "java" else "Python workers"] += seconds
    return totals


@contextlib.contextmanager
def measure() -> Iterator[_Took]:
    took = _Took()
    wall, cpu = time.perf_counter(), time.process_time()
    yield took
    took.wall = time.perf_counter() - wall
    took.cpu = time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--data-size", type=int, default=100)
    parser.add_argument("--split", type=int, default=250_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeat", type=int, default=2, help="Spark scans to time")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

    from waltz_spark import LogReader, register
    from waltz_spark.blocks import block_to_batch
    from waltz_spark.datasource import ARROW_SCHEMA
    from waltz_spark.testing import BackgroundCluster

    per_partition = args.transactions // args.partitions
    total = per_partition * args.partitions
    with tempfile.TemporaryDirectory(prefix="waltz-spark-bench-") as tmp:
        cluster = BackgroundCluster(
            Path(tmp), partitions=args.partitions, preload=per_partition, data_size=args.data_size
        )
        began = time.perf_counter()
        cluster.start()
        print(
            f"log: {total} transactions of {args.data_size} B in {args.partitions} partitions, "
            f"written and served in {time.perf_counter() - began:.1f} s"
        )
        try:
            print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

            # the storage engine, in process
            async def raw(blocks: bool) -> int:
                engine = cluster.nodes[0].engine
                count = 0
                for p in range(args.partitions):
                    stored = engine.partition(p)
                    at = 0
                    while at < per_partition:
                        if blocks:
                            n = len(await stored.read_block(at, 10_000))
                        else:
                            n = len(await stored.read_records(at, 10_000))
                        count += n
                        at += n
                return count

            for blocks in (False, True):
                with measure() as took:
                    count = cluster.run(raw(blocks), timeout=600)
                name = "read_block  " if blocks else "read_records"
                print(f"storage engine {name}:            {took.rate(count)}")

            # the wire, one reader in this process
            with measure() as took:
                count = 0
                with LogReader(cluster.uri) as reader:
                    for p in range(args.partitions):
                        for records in reader.read(p, 0, per_partition):
                            count += len(records)
            print(f"LogReader.read (records):               {took.rate(count)}")
            with measure() as took:
                count = 0
                with LogReader(cluster.uri) as reader:
                    for p in range(args.partitions):
                        for block, offsets in reader.read_blocks(p, 0, per_partition):
                            count += block_to_batch(p, block, offsets, ARROW_SCHEMA).num_rows
            print(f"LogReader.read_blocks + Arrow batches:  {took.rate(count)}")

            from pyspark.sql import DataFrame, SparkSession
            from pyspark.sql import functions as F

            spark = (
                SparkSession.builder.master(args.master)
                .appName("waltz-spark-bench")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.enabled", "false")
                .config("spark.driver.memory", "2g")
                .config("spark.ui.showConsoleProgress", "false")
                .getOrCreate()
            )
            try:
                register(spark)

                def load() -> DataFrame:
                    return (
                        spark.read.format("waltz")
                        .option("coordination", cluster.uri)
                        .option("transactionsPerSplit", str(args.split))
                        .load()
                    )

                warm = load().where(f"transaction_id < {min(20_000, per_partition)}")
                warm.count()
                for _ in range(args.repeat):
                    df = load()
                    before = _process_cpu()
                    began = time.perf_counter()
                    row = df.agg(
                        F.count("*").alias("rows"), F.sum(F.length("data")).alias("bytes")
                    ).collect()[0]
                    seconds = time.perf_counter() - began
                    after = _process_cpu()
                    assert row["rows"] == total, row
                    print(
                        f"Spark {args.master} scan: {row['rows']} rows, {row['bytes']} data "
                        f"bytes in {seconds:.1f} s: {row['rows'] / seconds:12,.0f} rows/s "
                        f"(goal 200,000 rows/s; load average {os.getloadavg()[0]:.1f})"
                    )
                    spent = ", ".join(f"{k} {after[k] - before[k]:.1f} s" for k in after)
                    print(f"  CPU during the scan: {spent}")
            finally:
                spark.stop()
        finally:
            cluster.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS (driver process): {peak:.0f} MiB")
    asyncio.set_event_loop(None)


if __name__ == "__main__":
    main()
