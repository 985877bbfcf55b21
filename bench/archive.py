"""Benchmark of tiered storage (docs/archive.md). Prints figures; never a pass/fail test.

    SPARK_LOCAL_IP=127.0.0.1 python bench/archive.py [--backlog 1000000] [--seconds 60]
        [--data-size 100] [--s3] [--no-spark]

A real cluster in this process (local coordination, 3 fs storage nodes with 1 MiB
segments, ZeroMQ, the server archiving to a local directory, or with ``--s3`` to moto's
S3 server on loopback), then, in one run:

1. **Backlog**: ``--backlog`` transactions written straight to the storage engines
   before the server starts; the archiver archives them (records/s and MB/s of
   archiving alone, read from the replicas, written as Parquet and read back).
2. **Live**: a client appends for ``--seconds`` while the archiver runs; printed per
   interval: the append rate, the archive rate, the archive lag, and the local disk
   bytes of one storage node's partition (retention keeps it flat: the newest 8 MiB of
   segments, the open one, and what waits for a 2 MiB range) beside the bytes in the archive.
3. **Spark**: a full scan of the archived history (``count`` and the sum of the data
   lengths) from the Parquet files, and the same ids through the servers
   (``archive=false``; the server reads them from the archive too, so this is the
   server path, not the storage nodes); rows/s of each (goal: 1,000,000 rows/s from
   the archive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
PARTITION = 0


def directory_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--data-size", type=int, default=100)
    parser.add_argument("--s3", action="store_true", help="archive to moto's S3 server")
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

    from waltz_archive.testing import S3Server
    from waltz_spark import LogReader
    from waltz_spark.testing import BackgroundCluster

    with tempfile.TemporaryDirectory(prefix="waltz-archive-bench-") as tmp:
        root = Path(tmp)
        s3 = None
        storage_options: dict[str, Any] = {}
        if args.s3:
            s3 = S3Server(root / "s3").start()
            s3.create_bucket("bench")
            url = s3.url("bench")
            storage_options = s3.storage_options
        else:
            url = f"file://{root / 'archive'}"
        settings = {
            "archive": {
                "url": url,
                "storage_options": storage_options,
                "min_range_bytes": 2 * MiB,
                "max_range_bytes": 64 * MiB,
                "max_local_bytes": 8 * MiB,
                "max_local_age": 0,
                "row_group_bytes": 4 * MiB,
                "interval": 0.5,
            }
        }
        cluster = BackgroundCluster(
            root,
            partitions=1,
            preload=args.backlog,
            data_size=args.data_size,
            server_settings=settings,
            storage_options={"segment_size": 1 * MiB},
        )
        try:
            began = time.perf_counter()
            cluster.start()
            print(
                f"backlog: {args.backlog} transactions of {args.data_size} B written to the "
                f"storage nodes and served in {time.perf_counter() - began:.1f} s; archive: "
                f"{'S3 (moto, loopback)' if s3 else 'local directory'}"
            )
            run_backlog(cluster, args)
            run_live(cluster, args, root, s3)
            if not args.no_spark:
                with LogReader(cluster.uri) as reader:
                    mark = reader.archive_marks([PARTITION])[PARTITION]
                run_spark(cluster, args, mark.mark, storage_options)
        finally:
            cluster.stop()
            if s3 is not None:
                s3.stop()
    asyncio.set_event_loop(None)


def _mark(uri: str) -> int:
    from waltz_spark import LogReader

    with LogReader(uri) as reader:
        return reader.archive_marks([PARTITION])[PARTITION].mark


def run_backlog(cluster: Any, args: argparse.Namespace) -> None:
    """Until the archiver stops advancing: the backlog is archived down to retention."""
    started = time.perf_counter()
    mark, moved_at = -1, started
    while time.perf_counter() - started < 900:
        found = _mark(cluster.uri)
        now = time.perf_counter()
        if found != mark:
            mark, moved_at = found, now
        elif now - moved_at > 8.0:  # rounds every 0.5 s found nothing more to do
            break
        time.sleep(0.2)
    seconds = moved_at - started
    records = mark + 1
    megabytes = records * args.data_size / MiB
    print(
        f"archiving the backlog: {records:,} records in {seconds:.1f} s: "
        f"{records / seconds:,.0f} records/s, {megabytes / seconds:.1f} MB/s of data "
        f"(read from the replicas, written as Parquet, read back and verified; "
        f"{args.backlog - records:,} kept local by retention)"
    )


def run_live(cluster: Any, args: argparse.Namespace, root: Path, s3: Any) -> None:
    """Append for ``--seconds`` with the client library while the archiver runs."""
    from waltz_client import ClientConfig, WaltzClient
    from waltz_spark import LogReader
    from waltz_spark.testing import _Ignore, _Put

    stop = threading.Event()
    lock = threading.Lock()
    appended = [0]
    payload = b"x" * args.data_size

    with LogReader(cluster.uri) as reader:
        caught_up = reader.high_water_marks([PARTITION])[PARTITION]

    def appender() -> None:
        callbacks = _Ignore()
        callbacks.marks[PARTITION] = caught_up  # an application that is up to date
        with WaltzClient(callbacks, ClientConfig(cluster.uri, transport="zmq")) as client:
            pending: list[Any] = []
            while not stop.is_set():
                pending.append(client.submit(_Put(PARTITION, 0, payload)))
                if len(pending) >= 500:
                    for future in pending:
                        future.result(timeout=120)
                    with lock:
                        appended[0] += len(pending)
                    pending = []
            for future in pending:
                future.result(timeout=120)
            with lock:
                appended[0] += len(pending)

    partition_dir = root / "storage-0" / str(PARTITION)
    threads = [threading.Thread(target=appender, name=f"appender-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    print(
        "live (4 client threads):\n"
        "      t(s)  appended/s   archived/s   archive lag   local bytes (node 0)   archive bytes"
    )
    start_mark = _mark(cluster.uri)
    last_mark, last_appended, last_time = start_mark, 0, time.perf_counter()
    began = last_time
    samples: list[int] = []
    try:
        while time.perf_counter() - began < args.seconds:
            time.sleep(5.0)
            now = time.perf_counter()
            mark = _mark(cluster.uri)
            count = appended[0]
            local = directory_bytes(partition_dir)
            samples.append(local)
            if s3 is not None:
                archived = sum(
                    int(info["size"])
                    for info in s3.filesystem().find("bench/waltz", detail=True).values()
                )
            else:
                archived = directory_bytes(root / "archive")
            with LogReader(cluster.uri) as reader:
                top = reader.high_water_marks([PARTITION])[PARTITION]
            print(
                f"      {now - began:5.0f} {(count - last_appended) / (now - last_time):11,.0f} "
                f"{(mark - last_mark) / (now - last_time):12,.0f} {top - mark:13,} "
                f"{local:22,} {archived:15,}"
            )
            last_mark, last_appended, last_time = mark, count, now
    finally:
        stop.set()
        for thread in threads:
            thread.join(180)
    seconds = time.perf_counter() - began
    total_archived = _mark(cluster.uri) - start_mark
    print(
        f"live totals: {appended[0]:,} appended ({appended[0] / seconds:,.0f}/s, "
        f"{appended[0] * args.data_size / MiB / seconds:.2f} MB/s) and {total_archived:,} "
        f"archived ({total_archived / seconds:,.0f}/s) in {seconds:.0f} s; local bytes "
        f"min {min(samples):,} max {max(samples):,} over the run"
    )


def run_spark(
    cluster: Any, args: argparse.Namespace, mark: int, storage_options: dict[str, Any]
) -> None:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql import functions as F

    from waltz_spark import register

    spark = (
        SparkSession.builder.master(args.master)
        .appName("waltz-archive-bench")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    try:
        register(spark)

        def load(archive: bool) -> DataFrame:
            reader = (
                spark.read.format("waltz")
                .option("coordination", cluster.uri)
                .option("endTransactionId", str(mark + 1))
                .option("transactionsPerSplit", "500000")
                .option("archive", "true" if archive else "false")
            )
            if storage_options:
                reader = reader.option("archiveStorageOptions", json.dumps(storage_options))
            return reader.load()

        load(True).where("transaction_id < 20000").count()  # warm-up
        for archive in (True, False, True):
            began = time.perf_counter()
            row = (
                load(archive)
                .agg(F.count("*").alias("rows"), F.sum(F.length("data")).alias("bytes"))
                .collect()[0]
            )
            seconds = time.perf_counter() - began
            assert row["rows"] == mark + 1, row
            print(
                f"Spark {args.master} scan of the archived ids 0..{mark} "
                f"{'from the Parquet files' if archive else 'through the server'}: "
                f"{row['rows']:,} rows in {seconds:.1f} s: {row['rows'] / seconds:12,.0f} rows/s "
                f"(load average {os.getloadavg()[0]:.1f})"
            )
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
