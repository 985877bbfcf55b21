"""Benchmark of the ``waltz`` Spark data source: rows/s of a batch read.

Prints figures; never a pass/fail test. Usage::

    SPARK_LOCAL_IP=127.0.0.1 python bench/spark_read.py [--transactions 1000000]
        [--partitions 2] [--data-size 100] [--split 250000] [--master local[2]]

A real cluster in this process (local coordination, 3 fs storage nodes, ZeroMQ, the
server); the log is written straight to the storage engines before the server starts
(``--transactions`` in all, spread over the partitions). Then, in the same run:

- the storage engine's raw range read (``read_records`` of 10000, in process);
- the wire: :class:`waltz_spark.LogReader` (RangeReadRequest loop) from this process;
- Spark: ``spark.read.format("waltz")`` on ``--master``, a full scan
  (``count`` and the sum of the data lengths, so every column is produced),
  after a warm-up read of the first splits;
- peak RSS of this process (the driver; executors are Python workers of Spark).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--data-size", type=int, default=100)
    parser.add_argument("--split", type=int, default=250_000)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

    from waltz_spark import LogReader, register
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
            # the storage engine, in process
            async def raw() -> int:
                engine = cluster.nodes[0].engine
                count = 0
                for p in range(args.partitions):
                    stored = engine.partition(p)
                    at = 0
                    while at < per_partition:
                        records = await stored.read_records(at, 10_000)
                        count += len(records)
                        at += len(records)
                return count

            began = time.perf_counter()
            count = cluster.run(raw(), timeout=600)
            seconds = time.perf_counter() - began
            print(f"storage engine read_records: {count / seconds:12,.0f} records/s")

            # the wire, one reader in this process
            began = time.perf_counter()
            count = 0
            with LogReader(cluster.uri) as reader:
                for p in range(args.partitions):
                    for records in reader.read(p, 0, per_partition):
                        count += len(records)
            seconds = time.perf_counter() - began
            print(f"LogReader (range read, 1 conn): {count / seconds:12,.0f} records/s")

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
                df = load()
                began = time.perf_counter()
                row = df.agg(
                    F.count("*").alias("rows"), F.sum(F.length("data")).alias("bytes")
                ).collect()[0]
                seconds = time.perf_counter() - began
                assert row["rows"] == total, row
                print(
                    f"Spark {args.master} scan: {row['rows']} rows, {row['bytes']} data bytes in "
                    f"{seconds:.1f} s: {row['rows'] / seconds:12,.0f} rows/s "
                    f"(goal 200,000 rows/s)"
                )
            finally:
                spark.stop()
        finally:
            cluster.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS (driver process): {peak:.0f} MiB")
    asyncio.set_event_loop(None)


if __name__ == "__main__":
    main()
